//! What the API sends, rendered once and shared: a frame's JSON (the
//! snapshot's body and every stream's event), the runs' list. However many
//! clients ask, and however slowly they read, each holds a reference to
//! the same bytes, not a copy of its own.

use std::sync::{Arc, Mutex};

use bytes::Bytes;

use crate::output::live::Frame;

/// A frame's JSON, made at the first ask after the frame changed.
#[derive(Debug, Default)]
pub struct FrameJson {
    last: Mutex<Option<(Arc<Frame>, Bytes)>>,
}

impl FrameJson {
    /// `frame`'s JSON: the one already made, or made now (others asking
    /// meanwhile wait for it rather than make their own).
    pub fn of(&self, frame: &Arc<Frame>) -> Bytes {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((f, json)) = last.as_ref() {
            if Arc::ptr_eq(f, frame) {
                return json.clone();
            }
        }
        let json = match serde_json::to_vec(frame.as_ref()) {
            Ok(v) => Bytes::from(v),
            Err(e) => Bytes::from(format!("{{\"error\":\"unencodable frame: {e}\"}}")),
        };
        *last = Some((frame.clone(), json.clone()));
        json
    }
}

/// A body made once until it is changed (the runs' list).
#[derive(Debug, Default)]
pub struct Cached {
    body: Mutex<Option<Bytes>>,
}

impl Cached {
    pub fn get_or(&self, make: impl FnOnce() -> Bytes) -> Bytes {
        let mut b = self.body.lock().unwrap_or_else(|p| p.into_inner());
        b.get_or_insert_with(make).clone()
    }

    pub fn forget(&self) {
        *self.body.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_is_rendered_once_for_every_reader() {
        let j = FrameJson::default();
        let f = Arc::new(Frame {
            at_s: 7.0,
            ..Default::default()
        });
        let a = j.of(&f);
        let b = j.of(&f);
        // The same bytes, not equal copies.
        assert_eq!(a.as_ptr(), b.as_ptr());
        let g = Arc::new(Frame {
            at_s: 8.0,
            ..Default::default()
        });
        assert_ne!(j.of(&g).as_ptr(), a.as_ptr());
    }
}
