//! BRP sessions: the connections an initiator opened to one volume under
//! one id, each in its slot, and the fence that keeps a lost connection's
//! writes from landing after the initiator's retries.
//!
//! When OPEN joins a session in a slot that a connection already holds, that
//! connection is lost as far as its initiator is concerned (it is
//! reconnecting): it is stopped at once ([`Activity::stop`]). The new
//! connection's OPEN_REPLY waits for the [`Fence`]: every stopped connection
//! of the session has finished what it started on the device. An initiator
//! retries a failed request only after that reply, so no write of a dead
//! connection can land after a newer one.

use crate::fence::Activity;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

#[derive(Debug)]
struct Member {
    slot: u16,
    activity: Arc<Activity>,
    /// Its connection is still open (its guard not dropped).
    open: bool,
}

#[derive(Debug)]
struct Session {
    volume: String,
    /// The identity that started it: only it may join (or take over a slot).
    owner: String,
    members: Vec<Member>,
}

impl Session {
    /// Forgets members whose connection closed and whose work is done.
    fn prune(&mut self) {
        self.members.retain(|m| m.open || !m.activity.is_drained());
    }
}

#[derive(Default, Debug)]
pub struct Sessions {
    map: Mutex<HashMap<u64, Session>>,
}

/// What a connection opened in a session must wait for before it answers:
/// every stopped connection of the session drained.
pub type Fence = Pin<Box<dyn Future<Output = ()> + Send>>;

impl Sessions {
    /// Joins session `id` (0: a new one) in `slot`. An unknown id is taken as
    /// given, so an initiator keeps its session across a target restart (the
    /// initiator checks the volume's generation). A connection already in
    /// `slot` is stopped. Returns the connection's membership (it leaves the
    /// session when the guard drops, whatever path it ends by) and the fence
    /// its OPEN_REPLY waits for.
    /// Only the identity `owner` that started the session may join it.
    /// `takeover` (OPEN's `OPEN_TAKEOVER`: a restarted client taking over
    /// its predecessor's session): every open connection of the session is
    /// stopped, whatever its slot, so the new incarnation's first OPEN_REPLY
    /// waits for all the predecessor's work, also in slots it will not open
    /// again (it may come back with fewer connections).
    pub fn join(
        self: &Arc<Self>,
        id: u64,
        slot: u16,
        volume: &str,
        owner: &str,
        takeover: bool,
    ) -> Result<(SessionGuard, Fence), String> {
        let mut map = self.map.lock();
        let id = if id != 0 {
            id
        } else {
            // A new session: a good moment to forget old ones that are done.
            map.retain(|_, s| {
                s.prune();
                !s.members.is_empty()
            });
            loop {
                let r = rand::random::<u64>();
                if r != 0 && !map.contains_key(&r) {
                    break r;
                }
            }
        };
        let s = map.entry(id).or_insert_with(|| Session {
            volume: volume.to_owned(),
            owner: owner.to_owned(),
            members: Vec::new(),
        });
        if s.volume != volume {
            return Err(format!("session {id:016x} belongs to volume {:?}", s.volume));
        }
        if s.owner != owner {
            return Err(format!("session {id:016x} belongs to another identity"));
        }
        s.prune();
        let mut replaced = 0;
        for m in s.members.iter().filter(|m| (takeover || m.slot == slot) && m.open) {
            m.activity.abandon();
            replaced += 1;
        }
        let waits: Vec<Arc<Activity>> =
            s.members.iter().filter(|m| m.activity.is_stopped()).map(|m| m.activity.clone()).collect();
        if takeover && replaced > 0 {
            tracing::info!(
                session = format_args!("{id:016x}"),
                replaced,
                "session taken over by a restarted client: its predecessor's connections stopped"
            );
        }
        if replaced > 0 || !waits.is_empty() {
            tracing::debug!(
                session = format_args!("{id:016x}"),
                slot,
                replaced,
                takeover,
                fenced = waits.len(),
                "connection re-opened: waiting for the session's lost connections to finish"
            );
        }
        let activity = Activity::new();
        s.members.push(Member { slot, activity: activity.clone(), open: true });
        let fence: Fence = Box::pin(async move {
            for a in waits {
                a.drained().await;
            }
        });
        Ok((SessionGuard { sessions: self.clone(), id, activity }, fence))
    }

    /// Open connections in session `id` now.
    pub fn connections(&self, id: u64) -> usize {
        self.map.lock().get(&id).map_or(0, |s| s.members.iter().filter(|m| m.open).count())
    }
}

/// A connection's membership in a session.
#[derive(Debug)]
pub struct SessionGuard {
    sessions: Arc<Sessions>,
    id: u64,
    activity: Arc<Activity>,
}

impl SessionGuard {
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The connection's activity: stopped when a reconnect takes its slot.
    pub fn activity(&self) -> &Arc<Activity> {
        &self.activity
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        // A closed connection dispatches nothing more; what it started may
        // still run, and later fences of the session wait for it.
        self.activity.stop();
        let mut map = self.sessions.map.lock();
        if let Some(s) = map.get_mut(&self.id) {
            for m in s.members.iter_mut().filter(|m| Arc::ptr_eq(&m.activity, &self.activity)) {
                m.open = false;
            }
            s.prune();
            if s.members.is_empty() {
                map.remove(&self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_session_lives_while_a_connection_holds_it_and_keeps_its_volume() {
        let s = Arc::new(Sessions::default());
        let (a, _) = s.join(0, 0, "v", "alice", false).unwrap();
        let id = a.id();
        assert_ne!(id, 0);
        let (b, _) = s.join(id, 1, "v", "alice", false).unwrap();
        assert_eq!(s.connections(id), 2);
        assert!(s.join(id, 2, "w", "alice", false).err().unwrap().contains("belongs to volume \"v\""));
        assert!(
            s.join(id, 2, "v", "bob", false).err().unwrap().contains("another identity"),
            "bob cannot join alice's"
        );
        drop(a);
        assert_eq!(s.connections(id), 1);
        drop(b);
        assert_eq!(s.connections(id), 0);
        let (again, _) = s.join(id, 0, "w", "alice", false).unwrap();
        assert_eq!(again.id(), id, "a resumed id is taken as given");
    }

    #[tokio::test]
    async fn a_reconnect_stops_its_slot_and_waits_for_what_the_lost_connection_started() {
        let s = Arc::new(Sessions::default());
        let (c1, _) = s.join(0, 0, "v", "alice", false).unwrap();
        let id = c1.id();
        let (c2, _) = s.join(id, 1, "v", "alice", false).unwrap();
        let job = c1.activity().begin().expect("c1 runs a write");
        // Slot 0 reconnects while c1 still looks open to the target.
        let (c1b, fence) = s.join(id, 0, "v", "alice", false).unwrap();
        assert!(c1.activity().is_stopped(), "the lost connection dispatches nothing more");
        assert!(!c2.activity().is_stopped(), "other slots go on");
        let fence = tokio::spawn(fence);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!fence.is_finished(), "the reply waits for the lost connection's write");
        drop(job);
        tokio::time::timeout(Duration::from_secs(5), fence).await.unwrap().unwrap();
        // A closed connection with work still running fences later joins too.
        let job = c2.activity().begin().unwrap();
        drop(c2);
        let (_c3, fence) = s.join(id, 1, "v", "alice", false).unwrap();
        let fence = tokio::spawn(fence);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!fence.is_finished());
        drop(job);
        tokio::time::timeout(Duration::from_secs(5), fence).await.unwrap().unwrap();
        drop((c1, c1b));
    }

    /// A restarted client takes its session over with fewer connections
    /// while the old ones still look open: its first OPEN stops every one of
    /// them and waits for their work, the slots it does not open too.
    #[tokio::test]
    async fn a_takeover_stops_every_slot_and_waits_for_all_their_work() {
        let s = Arc::new(Sessions::default());
        let (old0, _) = s.join(0, 0, "v", "alice", false).unwrap();
        let id = old0.id();
        let old: Vec<_> = (1..4).map(|slot| s.join(id, slot, "v", "alice", false).unwrap().0).collect();
        let job = old[2].activity().begin().expect("slot 3 runs a write");
        // Without the flag, re-opening slot 0 stops slot 0 only.
        let (new0, fence) = s.join(id, 0, "v", "alice", false).unwrap();
        assert!(old0.activity().is_stopped());
        assert!(old.iter().all(|c| !c.activity().is_stopped()), "a reconnect leaves the other slots");
        tokio::time::timeout(Duration::from_secs(5), fence).await.unwrap();
        drop(new0);
        // With it: every slot stopped, and the reply waits for slot 3's write.
        let (_new, fence) = s.join(id, 0, "v", "alice", true).unwrap();
        assert!(old.iter().all(|c| c.activity().is_stopped()), "every slot of the predecessor");
        let fence = tokio::spawn(fence);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!fence.is_finished(), "the takeover waits for slot 3's write");
        drop(job);
        tokio::time::timeout(Duration::from_secs(5), fence).await.unwrap().unwrap();
        // The new incarnation's next slots join as usual, without stopping slot 0.
        let (_new1, fence) = s.join(id, 1, "v", "alice", false).unwrap();
        tokio::time::timeout(Duration::from_secs(5), fence).await.unwrap();
        assert!(!_new.activity().is_stopped());
    }
}
