//! Block device identity: the kernel's internal dev_t (major << 20 | minor)
//! as the eBPF programs report it.

use std::fmt;

const MINORBITS: u32 = 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Dev(pub u32);

impl Dev {
    pub fn new(major: u32, minor: u32) -> Self {
        Dev((major << MINORBITS) | minor)
    }
    pub fn major(self) -> u32 {
        self.0 >> MINORBITS
    }
    pub fn minor(self) -> u32 {
        self.0 & ((1 << MINORBITS) - 1)
    }
}

impl fmt::Display for Dev {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.major(), self.minor())
    }
}
