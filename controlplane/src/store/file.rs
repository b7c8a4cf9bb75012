//! The Raft log's entries in one append-only file.
//!
//! Layout: an 8-byte magic, then one record per entry. A record that starts an append: a u32
//! (little endian), the payload's length; the payload's CRC-32 (u32, little endian); the
//! payload, the entry as JSON (the same encoding on the wire and in snapshots, so an entry
//! reads the same in every build). A record that continues an append: the length with its top
//! bit set; the CRC-32 of the next field and the payload; the record's place in its append
//! (u32, 1 for the second record); the payload.
//!
//! An append is one `write` and one `fdatasync`, so a crash can only damage what was written
//! after the last completed append, none of which was acknowledged. A power loss can keep
//! any of that append's pages without the others: a record of it cut short, garbled or
//! zeroed, with whole records of the same append after it, and a garbled sector may take the
//! end of the append before it too. At open, a bad record is cut away with everything after
//! it only where it can lie inside the last append: no whole record after it starts an
//! append, every whole record after it continues an append that began at or before the bad
//! record's index (its place says where), and that index is past the committed and purged
//! ones, which are known to be acknowledged. Anything else fails the open rather than drop
//! acknowledged entries. What remains indistinguishable from a torn append is damage to an
//! acknowledged last append past the committed index (a flipped bit after a clean stop): it
//! is dropped as format 1 dropped a damaged last record, and the node then catches up from
//! the leader.
//!
//! Format 1 (`PCRLOG01`) had no continuing records: each record was an append of its own,
//! which reads the same under format 2's rule. A format-1 log gets format 2's magic at open,
//! before anything is appended, so that a build that knows only format 1 refuses the file
//! instead of misreading a continuing record's length as a record cut short.
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

const MAGIC: &[u8; 8] = b"PCRLOG02";
/// Format 1: every record an append of its own (see the module's documentation).
const MAGIC_FORMAT_1: &[u8; 8] = b"PCRLOG01";
/// What every format's magic starts with, followed by the format's number in two digits.
const MAGIC_FAMILY: &[u8] = b"PCRLOG";
const MAGIC_LEN: u64 = MAGIC.len() as u64;
/// A record that starts an append: length and checksum.
const HEADER_LEN: u64 = 8;
/// A record that continues an append: its place in the append too.
const CONTINUING_HEADER_LEN: u64 = 12;
/// The length word's top bit: the record continues the append of the record before it.
const CONTINUES: u32 = 1 << 31;
/// Purged bytes below this are never compacted away: rewriting for less costs more than it frees.
const COMPACT_MIN_BYTES: u64 = 1024 * 1024;

/// Where one held entry's record lies in the file.
#[derive(Debug, Clone, Copy)]
struct Record {
    log_id: LogId,
    offset: u64,
    header_len: u8,
    payload_len: u32,
}

impl Record {
    fn payload_start(&self) -> u64 {
        self.offset + u64::from(self.header_len)
    }

    fn end(&self) -> u64 {
        self.payload_start() + u64::from(self.payload_len)
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
    /// up to `last_purged` are skipped; what a crash left of the last append is dropped, never
    /// an entry up to `committed` or `last_purged`; anything else that does not read as a
    /// contiguous log fails the open rather than serve a log with a hole. A format-1 log gets
    /// format 2's magic.
    pub fn open(
        path: &Path,
        last_purged: Option<LogId>,
        committed: Option<LogId>,
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
            for (place, entry) in initial()?.iter().enumerate() {
                encode(entry, place, &mut contents)?;
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
        let magic = contents.get(..MAGIC.len());
        let format_1 = magic == Some(MAGIC_FORMAT_1.as_slice());
        if magic != Some(MAGIC.as_slice()) && !format_1 {
            let newer = magic
                .and_then(|magic| magic.strip_prefix(MAGIC_FAMILY))
                .and_then(|version| std::str::from_utf8(version).ok()?.parse::<u8>().ok())
                .is_some_and(|version| version > 2);
            if newer {
                bail!(
                    "the Raft log {} is in a format this build does not know (a newer build wrote it); \
                     run that build, or restore this node from its peers",
                    path.display()
                );
            }
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
                // The index the bad record would hold; the file's first record's is not known.
                let index = previous.map(|previous| previous.saturating_add(1));
                let acknowledged = committed.max(last_purged).map(|id| id.index);
                if !is_torn_tail(&contents, offset, index, acknowledged) {
                    bail!(
                        "the Raft log {} has a damaged record at byte {offset} that is not part of \
                         the last append, or holds entries known to be committed: acknowledged \
                         entries would be lost; restore this node from its peers (remove it from \
                         the cluster, clear its data directory, add it again)",
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
                "the Raft log ends in an append cut short (a crash before it was acknowledged); dropping it"
            );
            log.file
                .set_len(log.end)
                .and_then(|()| log.file.sync_data())
                .with_context(|| {
                    format!("cutting the Raft log {} back to its last record", path.display())
                })?;
        }
        if format_1 {
            // Format 1's records read the same in format 2: only the magic changes, eight
            // bytes inside one sector, so a crash leaves one magic or the other.
            log.file
                .write_all_at(MAGIC, 0)
                .and_then(|()| log.file.sync_data())
                .with_context(|| format!("upgrading the Raft log {} to format 2", path.display()))?;
            tracing::info!(log = %path.display(), "upgraded the Raft log to format 2");
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
                let at = usize::try_from(record.payload_start() - from.offset).map_err(io::Error::other)?;
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
        for (place, entry) in entries.iter().enumerate() {
            let index = entry.log_id.index;
            if expected.is_some_and(|expected| index != expected) {
                return Err(io::Error::other(format!(
                    "entry {index} appended where the log expects entry {}",
                    expected.unwrap_or_default()
                )));
            }
            let offset = self.end + bytes.len() as u64;
            let record = encode(entry, place, &mut bytes).map_err(io::Error::other)?;
            records.push(Record { offset, ..record });
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

/// Whether the bad record at `offset`, which would hold entry `index` (`None` for the file's
/// first record), can lie inside the last append, cut short by a crash. It cannot where its
/// index is up to `acknowledged` (committed or purged), where a whole record after it starts
/// an append or holds an entry up to `acknowledged`, or where one continues an append that
/// began after `index` (its place says where it began): the bad record was then written
/// before the last append, so acknowledged. Nor where a whole record after it does not
/// decode. A first record's index is at least where the append of a record after it began.
/// Judging by the bad header alone, a bit flipped in a length that then runs past the end
/// would pass for a torn tail and cut every record after it.
fn is_torn_tail(contents: &[u8], offset: u64, index: Option<u64>, acknowledged: Option<u64>) -> bool {
    let known = |index: u64| acknowledged.is_some_and(|acknowledged| index <= acknowledged);
    if index.is_some_and(known) {
        return false;
    }
    let Ok(start) = usize::try_from(offset) else {
        return true;
    };
    // Nearly every position fails at once (a length past the end, or zero); a checksum is
    // computed only where a length fits.
    (start.saturating_add(1)..contents.len()).all(|at| match whole_record_at(contents, at) {
        None => true,
        Some(whole) if whole.place == 0 => false,
        Some(whole) => serde_json::from_slice::<Entry>(whole.payload).is_ok_and(|entry| {
            // Records after the bad one hold later entries: if one is acknowledged, so is
            // its append's start, which `bad` is at least.
            let Some(append_start) = entry.log_id.index.checked_sub(u64::from(whole.place)) else {
                return false;
            };
            let bad = index.unwrap_or(append_start);
            !known(bad) && append_start <= bad
        }),
    })
}

/// Appends `entry`'s record to `bytes`, at `place` in its append (0 starts it); returns the
/// record, its offset counted from the start of `bytes`' new part.
fn encode(entry: &Entry, place: usize, bytes: &mut Vec<u8>) -> anyhow::Result<Record> {
    let payload = serde_json::to_vec(entry).context("encoding a log entry")?;
    let payload_len = u32::try_from(payload.len())
        .ok()
        .filter(|length| length & CONTINUES == 0)
        .with_context(|| format!("log entry {} is over 2 GiB", entry.log_id.index))?;
    let place = u32::try_from(place).context("an append of over 4 billion entries")?;
    if place == 0 {
        bytes.extend_from_slice(&payload_len.to_le_bytes());
        bytes.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    } else {
        let mut checksum = crc32fast::Hasher::new();
        checksum.update(&place.to_le_bytes());
        checksum.update(&payload);
        bytes.extend_from_slice(&(payload_len | CONTINUES).to_le_bytes());
        bytes.extend_from_slice(&checksum.finalize().to_le_bytes());
        bytes.extend_from_slice(&place.to_le_bytes());
    }
    bytes.extend_from_slice(&payload);
    Ok(Record {
        log_id: entry.log_id,
        offset: 0,
        header_len: if place == 0 {
            HEADER_LEN
        } else {
            CONTINUING_HEADER_LEN
        } as u8,
        payload_len,
    })
}

/// A record that checks out, as found in the file.
struct Whole<'a> {
    payload: &'a [u8],
    header_len: u8,
    /// Its place in its append: 0 starts one.
    place: u32,
}

/// The whole record at `start` of `contents`; `None` where there is none: the end, or a
/// record cut short or garbled by a crash.
fn whole_record_at(contents: &[u8], start: usize) -> Option<Whole<'_>> {
    let word = u32::from_le_bytes(contents.get(start..start.checked_add(4)?)?.try_into().ok()?);
    let stored = u32::from_le_bytes(contents.get(start + 4..start + 8)?.try_into().ok()?);
    let mut checksum = crc32fast::Hasher::new();
    let (header_len, place) = if word & CONTINUES == 0 {
        (HEADER_LEN, 0)
    } else {
        let place = contents.get(start + 8..start + 12)?;
        checksum.update(place);
        (CONTINUING_HEADER_LEN, u32::from_le_bytes(place.try_into().ok()?))
    };
    let payload_len = (word & !CONTINUES) as usize;
    let payload_start = start + header_len as usize;
    let payload = contents.get(payload_start..payload_start.checked_add(payload_len)?)?;
    checksum.update(payload);
    // An empty payload is never written (an entry encodes to a JSON object), and a header of
    // zeros would pass the checksum: it is what a crash leaves in a file extended too early.
    // A continuing record is never at place 0.
    let valid = payload_len != 0 && (word & CONTINUES == 0) == (place == 0) && checksum.finalize() == stored;
    valid.then_some(Whole {
        payload,
        header_len: header_len as u8,
        place,
    })
}

/// The whole record at `offset` of `contents`, or `None` where there is none (see
/// [`whole_record_at`]). A whole record that does not decode as an entry is an error, not a
/// crash's leftover.
fn decode_at(contents: &[u8], offset: u64) -> anyhow::Result<Option<(Entry, Record)>> {
    let Some(whole) = usize::try_from(offset)
        .ok()
        .and_then(|start| whole_record_at(contents, start))
    else {
        return Ok(None);
    };
    let entry: Entry =
        serde_json::from_slice(whole.payload).context("a whole record does not decode as a log entry")?;
    let record = Record {
        log_id: entry.log_id,
        offset,
        header_len: whole.header_len,
        payload_len: u32::try_from(whole.payload.len())?,
    };
    Ok(Some((entry, record)))
}

#[cfg(test)]
mod tests;
