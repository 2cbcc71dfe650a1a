//! The PostgreSQL server log, where this process can read it (Debian's
//! `pg_ctlcluster` writes `/var/log/postgresql/postgresql-<version>-main.log`
//! with the prefix `%m [%p] %q%u@%d `): what a run left in it for one
//! database. Shared by `tests/server_errors.rs` and `benches/load.rs`.

use std::path::PathBuf;

/// The server log, read from where it was when opened.
pub struct ServerLog {
    path: PathBuf,
    from: u64,
}

impl ServerLog {
    /// The log as it is now, or `None` where there is none to read.
    pub fn open() -> Option<Self> {
        let path = std::fs::read_dir("/var/log/postgresql")
            .ok()?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| p.to_string_lossy().ends_with("-main.log"))?;
        let from = std::fs::metadata(&path).ok()?.len();
        Some(Self { path, from })
    }

    /// Where the log is.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// The errors and warnings logged for database `db` since the log was
    /// opened (or last read).
    pub fn problems(&mut self, db: &str) -> Vec<String> {
        let text = std::fs::read(&self.path).unwrap_or_default();
        let new = text.get(self.from as usize..).unwrap_or_default();
        self.from = text.len() as u64;
        let needle = format!("@{db} ");
        String::from_utf8_lossy(new)
            .lines()
            .filter(|line| line.contains(&needle))
            .filter(|line| {
                ["ERROR:", "WARNING:", "FATAL:"]
                    .iter()
                    .any(|l| line.contains(l))
            })
            .map(str::to_string)
            .collect()
    }
}
