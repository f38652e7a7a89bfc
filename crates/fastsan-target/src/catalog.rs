//! The volumes a target serves, by name and in configuration order (for LIST).

use crate::volume::Volume;
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Default)]
pub struct Catalog {
    by_name: HashMap<String, Arc<Volume>>,
    order: Vec<Arc<Volume>>,
}

impl Catalog {
    /// Adds a volume; its name must be new (the configuration checked it).
    pub fn add(&mut self, v: Volume) {
        let v = Arc::new(v);
        self.by_name.insert(v.name().to_owned(), v.clone());
        self.order.push(v);
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Volume>> {
        self.by_name.get(name)
    }

    /// Every volume, in configuration order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Volume>> {
        self.order.iter()
    }

    /// The volume an NBD export name names: `""` is the default export when
    /// there is exactly one volume.
    pub fn export(&self, name: &str) -> Option<&Arc<Volume>> {
        match (name, self.order.as_slice()) {
            ("", [only]) => Some(only),
            _ => self.get(name),
        }
    }
}
