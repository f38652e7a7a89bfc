//! BRP sessions: the connections an initiator opened to one volume under one id.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Debug)]
struct Session {
    volume: String,
    connections: usize,
}

#[derive(Default, Debug)]
pub struct Sessions {
    map: Mutex<HashMap<u64, Session>>,
}

impl Sessions {
    /// Joins session `id` (0: a new one). An unknown id is taken as given, so
    /// an initiator keeps its session across a target restart. The
    /// connection leaves the session when the guard drops, whatever path it
    /// ends by.
    pub fn join(self: &Arc<Self>, id: u64, volume: &str) -> Result<SessionGuard, String> {
        let mut map = self.map.lock();
        let id = if id != 0 {
            id
        } else {
            loop {
                let r = rand::random::<u64>();
                if r != 0 && !map.contains_key(&r) {
                    break r;
                }
            }
        };
        let s = map.entry(id).or_insert_with(|| Session { volume: volume.to_owned(), connections: 0 });
        if s.volume != volume {
            return Err(format!("session {id:016x} belongs to volume {:?}", s.volume));
        }
        s.connections += 1;
        Ok(SessionGuard { sessions: self.clone(), id })
    }

    /// Connections in session `id` now.
    pub fn connections(&self, id: u64) -> usize {
        self.map.lock().get(&id).map_or(0, |s| s.connections)
    }
}

/// A connection's membership in a session.
#[derive(Debug)]
pub struct SessionGuard {
    sessions: Arc<Sessions>,
    id: u64,
}

impl SessionGuard {
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        let mut map = self.sessions.map.lock();
        if let Some(s) = map.get_mut(&self.id) {
            s.connections -= 1;
            if s.connections == 0 {
                map.remove(&self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_lives_while_a_connection_holds_it_and_keeps_its_volume() {
        let s = Arc::new(Sessions::default());
        let a = s.join(0, "v").unwrap();
        let id = a.id();
        assert_ne!(id, 0);
        let b = s.join(id, "v").unwrap();
        assert_eq!(s.connections(id), 2);
        assert!(s.join(id, "w").unwrap_err().contains("belongs to volume \"v\""));
        drop(a);
        assert_eq!(s.connections(id), 1);
        drop(b);
        assert_eq!(s.connections(id), 0);
        let again = s.join(id, "w").unwrap();
        assert_eq!(again.id(), id, "a resumed id is taken as given");
    }
}
