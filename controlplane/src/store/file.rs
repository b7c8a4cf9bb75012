//! The Raft log's entries in one append-only file.
//!
//! Layout: an 8-byte magic, then one record per entry: the payload's length (u32, little
//! endian), its CRC-32 (u32, little endian), and the payload, the entry as JSON (the same
//! encoding on the wire and in snapshots, so an entry reads the same in every build).
//!
//! An append is one `write` and one `fdatasync`, so a crash can only damage the records written
//! after the last completed append, none of which was acknowledged: at open, a bad record is cut
//! away with what follows it when no whole record does (a torn last append). A bad record with a
//! whole record after it is damage to acknowledged entries, and the open fails rather than drop
//! them. (A power loss can also leave a later page of an unacknowledged append on disk without
//! an earlier one; records carry nothing that tells that apart, so it fails the open too, and
//! the node is restored from its peers.)
//!
//! Purged entries stay in the file until they outweigh the entries held; the file is then
//! rewritten with the held ones only (a new file renamed over the old), which keeps the disk
//! bounded by the snapshot policy.

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

use crate::types::{Entry, LogId};

const MAGIC: &[u8; 8] = b"PCRLOG01";
const MAGIC_LEN: u64 = MAGIC.len() as u64;
const HEADER_LEN: u64 = 8;
/// Purged bytes below this are never compacted away: rewriting for less costs more than it frees.
const COMPACT_MIN_BYTES: u64 = 1024 * 1024;

/// Where one held entry's record lies in the file.
#[derive(Debug, Clone, Copy)]
struct Record {
    log_id: LogId,
    offset: u64,
    payload_len: u32,
}

impl Record {
    fn end(&self) -> u64 {
        self.offset + HEADER_LEN + u64::from(self.payload_len)
    }
}

pub struct LogFile {
    path: PathBuf,
    file: File,
    /// The entries held (those after the last purged id), contiguous and in index order.
    records: VecDeque<Record>,
    /// Where the first held record starts; the bytes between the magic and here are
    /// purged records waiting for a compaction.
    live_start: u64,
    /// Where the next record goes.
    end: u64,
    last_purged: Option<LogId>,
}

impl LogFile {
    /// Opens the log at `path`, or creates it holding the entries `initial` returns. Records
    /// up to `last_purged` are skipped; a cut-off last record is dropped; anything else that
    /// does not read as a contiguous log fails the open rather than serve a log with a hole.
    pub fn open(
        path: &Path,
        last_purged: Option<LogId>,
        initial: impl FnOnce() -> anyhow::Result<Vec<Entry>>,
    ) -> anyhow::Result<Self> {
        let temporary = temporary_path(path);
        match fs::remove_file(&temporary) {
            Err(error) if error.kind() != io::ErrorKind::NotFound => {
                return Err(error).with_context(|| format!("removing {}", temporary.display()))
            }
            _ => {}
        }
        if !path.exists() {
            let mut contents = MAGIC.to_vec();
            for entry in initial()? {
                encode(&entry, &mut contents)?;
            }
            replace(path, &contents)?;
            sync_parent(path)?;
        }
        let contents = fs::read(path).with_context(|| format!("reading the Raft log {}", path.display()))?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .with_context(|| format!("opening the Raft log {}", path.display()))?;
        if contents.get(..MAGIC.len()) != Some(MAGIC.as_slice()) {
            bail!("{} is not a Portcullis Raft log (unknown header)", path.display());
        }
        let mut log = Self {
            path: path.to_owned(),
            file,
            records: VecDeque::new(),
            live_start: MAGIC_LEN,
            end: MAGIC_LEN,
            last_purged,
        };
        let mut previous: Option<u64> = None;
        loop {
            let offset = log.end;
            let Some((entry, record)) = decode_at(&contents, offset)
                .with_context(|| format!("the Raft log {} at byte {offset}", path.display()))?
            else {
                if !is_torn_tail(&contents, offset) {
                    bail!(
                        "the Raft log {} has a damaged record at byte {offset} with data after it: \
                         acknowledged entries would be lost; restore this node from its peers \
                         (remove it from the cluster, clear its data directory, add it again)",
                        path.display()
                    );
                }
                break;
            };
            let index = entry.log_id.index;
            if previous.is_some_and(|previous| index <= previous) {
                bail!(
                    "the Raft log {} holds entry {index} after entry {}: it is not in index order",
                    path.display(),
                    previous.unwrap_or_default()
                );
            }
            previous = Some(index);
            log.end = record.end();
            if last_purged.is_some_and(|purged| index <= purged.index) {
                log.live_start = log.end;
                continue;
            }
            if let Some(expected) = log.next_index() {
                if index != expected {
                    bail!(
                        "the Raft log {} lacks entries {expected}..{index}: entry {index} follows {}",
                        path.display(),
                        expected.saturating_sub(1)
                    );
                }
            }
            log.records.push_back(record);
        }
        let whole = contents.len() as u64;
        if log.end < whole {
            tracing::warn!(
                log = %path.display(),
                bytes = whole - log.end,
                "the Raft log ends in a record cut short (a crash during an unacknowledged append); dropping it"
            );
            log.file
                .set_len(log.end)
                .and_then(|()| log.file.sync_data())
                .with_context(|| {
                    format!("cutting the Raft log {} back to its last record", path.display())
                })?;
        }
        Ok(log)
    }

    /// The index the next entry must have: `None` while nothing was ever held.
    fn next_index(&self) -> Option<u64> {
        match self.records.back() {
            Some(last) => Some(last.log_id.index.saturating_add(1)),
            None => self.last_purged.map(|purged| purged.index.saturating_add(1)),
        }
    }

    pub fn last_log_id(&self) -> Option<LogId> {
        self.records.back().map(|record| record.log_id)
    }

    /// The held entries with indexes in `start..end` (`end` unbounded when `None`).
    pub fn read(&self, start: u64, end: Option<u64>) -> io::Result<Vec<Entry>> {
        let (Some(first), Some(last)) = (self.records.front(), self.records.back()) else {
            return Ok(Vec::new());
        };
        let start = start.max(first.log_id.index);
        let end = end.map_or(last.log_id.index + 1, |end| end.min(last.log_id.index + 1));
        if start >= end {
            return Ok(Vec::new());
        }
        // Held records are contiguous, so positions follow from indexes.
        let position = |index: u64| usize::try_from(index - first.log_id.index).unwrap_or(usize::MAX);
        let wanted = self.records.range(position(start)..position(end));
        let (Some(from), Some(to)) = (
            self.records.get(position(start)),
            self.records.get(position(end - 1)),
        ) else {
            return Ok(Vec::new());
        };
        let mut bytes = vec![0; usize::try_from(to.end() - from.offset).map_err(io::Error::other)?];
        self.file.read_exact_at(&mut bytes, from.offset)?;
        wanted
            .map(|record| {
                let at =
                    usize::try_from(record.offset - from.offset + HEADER_LEN).map_err(io::Error::other)?;
                let payload = bytes
                    .get(at..at + record.payload_len as usize)
                    .ok_or_else(|| io::Error::other("a log record lies outside what was read"))?;
                serde_json::from_slice(payload).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
            })
            .collect()
    }

    /// Appends `entries` and makes them durable before returning. openraft only ever appends
    /// right after the last entry (it truncates before it overwrites), but its storage test
    /// suite also appends over held entries, which then replace the log from their first index
    /// on, and below the purge point, where entries are skipped: the snapshot covers them.
    /// A hole is refused.
    pub fn append(&mut self, entries: &[Entry]) -> io::Result<()> {
        let purged = self
            .last_purged
            .map_or(0, |purged| purged.index.saturating_add(1));
        let entries = &entries[entries.partition_point(|entry| entry.log_id.index < purged)..];
        if let (Some(first), Some(last)) = (entries.first(), self.last_log_id()) {
            if first.log_id.index <= last.index {
                self.truncate(first.log_id.index)?;
            }
        }
        let mut bytes = Vec::new();
        let mut records = Vec::with_capacity(entries.len());
        let mut expected = self.next_index();
        for entry in entries {
            let index = entry.log_id.index;
            if expected.is_some_and(|expected| index != expected) {
                return Err(io::Error::other(format!(
                    "entry {index} appended where the log expects entry {}",
                    expected.unwrap_or_default()
                )));
            }
            let offset = self.end + bytes.len() as u64;
            let payload_len = encode(entry, &mut bytes).map_err(io::Error::other)?;
            records.push(Record {
                log_id: entry.log_id,
                offset,
                payload_len,
            });
            expected = Some(index.saturating_add(1));
        }
        if let Err(error) = self
            .file
            .write_all_at(&bytes, self.end)
            .and_then(|()| self.file.sync_data())
        {
            // Best effort: a later append then does not leave a partial record behind it.
            let _ = self.file.set_len(self.end);
            return Err(error);
        }
        self.end += bytes.len() as u64;
        self.records.extend(records);
        Ok(())
    }

    /// Removes the held entries from `index` on, durably.
    pub fn truncate(&mut self, index: u64) -> io::Result<()> {
        let Some(first) = self.records.front() else {
            return Ok(());
        };
        let keep = usize::try_from(index.saturating_sub(first.log_id.index)).unwrap_or(usize::MAX);
        let Some(cut) = self.records.get(keep).map(|record| record.offset) else {
            return Ok(());
        };
        self.file.set_len(cut)?;
        // The index follows the file at once: were the sync to fail, a later append must
        // still go where the file now ends, not leave a hole.
        self.records.truncate(keep);
        self.end = cut;
        self.file.sync_data()
    }

    /// Forgets the entries up to `log_id`, whose purge point the caller has made durable;
    /// rewrites the file once purged records outweigh the held ones.
    pub fn purge(&mut self, log_id: LogId) -> io::Result<()> {
        if self
            .last_purged
            .is_some_and(|purged| purged.index >= log_id.index)
        {
            return Ok(());
        }
        self.last_purged = Some(log_id);
        while self
            .records
            .front()
            .is_some_and(|record| record.log_id.index <= log_id.index)
        {
            self.records.pop_front();
        }
        self.live_start = self.records.front().map_or(self.end, |record| record.offset);
        let purged = self.live_start - MAGIC_LEN;
        if purged >= COMPACT_MIN_BYTES && purged >= self.end - self.live_start {
            // Compaction only frees space: a failure before the swap (a full disk, say) leaves
            // a longer file that reads the same, and the next purge tries again. Once swapped,
            // appends go to the new file, so its name must be durable before any is
            // acknowledged: otherwise a power loss could bring the old file back without them.
            match self.compact() {
                Ok(()) => sync_parent(&self.path).map_err(io::Error::other)?,
                Err(error) => {
                    tracing::warn!(log = %self.path.display(), %error, "could not compact the Raft log")
                }
            }
        }
        Ok(())
    }

    /// Rewrites the file with the held records only; the rename is not yet durable.
    fn compact(&mut self) -> io::Result<()> {
        let mut contents =
            vec![0; usize::try_from(MAGIC_LEN + self.end - self.live_start).map_err(io::Error::other)?];
        contents[..MAGIC.len()].copy_from_slice(MAGIC);
        self.file
            .read_exact_at(&mut contents[MAGIC.len()..], self.live_start)?;
        // The new file's handle is taken before the rename, so appends can never go to the
        // replaced (unlinked) file.
        let file = replace(&self.path, &contents).map_err(io::Error::other)?;
        let shift = self.live_start - MAGIC_LEN;
        self.file = file;
        for record in &mut self.records {
            record.offset -= shift;
        }
        self.end -= shift;
        self.live_start = MAGIC_LEN;
        tracing::debug!(log = %self.path.display(), freed = shift, "compacted the Raft log");
        Ok(())
    }
}

pub(super) fn temporary_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Writes `contents` to a new file, makes it durable and renames it over `path`; returns the
/// new file, open for reading and writing.
pub(super) fn replace(path: &Path, contents: &[u8]) -> anyhow::Result<File> {
    let temporary = temporary_path(path);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&temporary)
        .with_context(|| format!("creating {}", temporary.display()))?;
    file.write_all(contents)
        .and_then(|()| file.sync_all())
        .with_context(|| format!("writing {}", temporary.display()))?;
    fs::rename(&temporary, path).with_context(|| format!("renaming {} into place", temporary.display()))?;
    Ok(file)
}

/// Makes a rename in `path`'s directory durable.
pub(super) fn sync_parent(path: &Path) -> anyhow::Result<()> {
    if let Some(directory) = path.parent() {
        File::open(directory)
            .and_then(|directory| directory.sync_all())
            .with_context(|| format!("syncing {}", directory.display()))?;
    }
    Ok(())
}

/// Whether the bad record at `offset` can be the last append cut short by a crash: no whole
/// record follows it. A crash leaves only what the last, unacknowledged append wrote: a
/// record cut short, garbled, or zeros where a file extended too early has no data. Anything
/// that checks out after the bad record is damage to records already acknowledged; judging by
/// the bad header alone, a bit flipped in a length that then runs past the end would pass for
/// a torn tail and cut every record after it.
fn is_torn_tail(contents: &[u8], offset: u64) -> bool {
    let Ok(start) = usize::try_from(offset) else {
        return true;
    };
    // Nearly every position fails at once (a length past the end, or zero); a checksum is
    // computed only where a length fits, and a whole record decodes only where it matches.
    (start.saturating_add(1)..contents.len()).all(|at| matches!(decode_at(contents, at as u64), Ok(None)))
}

/// Appends `entry`'s record to `bytes`; returns its payload's length.
fn encode(entry: &Entry, bytes: &mut Vec<u8>) -> anyhow::Result<u32> {
    let payload = serde_json::to_vec(entry).context("encoding a log entry")?;
    let payload_len = u32::try_from(payload.len())
        .with_context(|| format!("log entry {} is over 4 GiB", entry.log_id.index))?;
    bytes.extend_from_slice(&payload_len.to_le_bytes());
    bytes.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    bytes.extend_from_slice(&payload);
    Ok(payload_len)
}

/// The whole record at `offset` of `contents`, or `None` where there is none: the end, or a
/// record cut short or garbled by a crash (what follows the last completed append). A whole
/// record that does not decode as an entry is an error, not a crash's leftover.
fn decode_at(contents: &[u8], offset: u64) -> anyhow::Result<Option<(Entry, Record)>> {
    let Ok(start) = usize::try_from(offset) else {
        return Ok(None);
    };
    let Some(header) = contents.get(start..start.saturating_add(HEADER_LEN as usize)) else {
        return Ok(None);
    };
    let (length, checksum) = header.split_at(4);
    let payload_len = u32::from_le_bytes(length.try_into()?);
    let checksum = u32::from_le_bytes(checksum.try_into()?);
    let payload_start = start + HEADER_LEN as usize;
    let Some(payload) = contents.get(payload_start..payload_start.saturating_add(payload_len as usize))
    else {
        return Ok(None);
    };
    // An empty payload is never written (an entry encodes to a JSON object), and a header of
    // zeros would pass the checksum: it is what a crash leaves in a file extended too early.
    if payload_len == 0 || crc32fast::hash(payload) != checksum {
        return Ok(None);
    }
    let entry: Entry =
        serde_json::from_slice(payload).context("a whole record does not decode as a log entry")?;
    let record = Record {
        log_id: entry.log_id,
        offset,
        payload_len,
    };
    Ok(Some((entry, record)))
}

#[cfg(test)]
mod tests;
