use std::fs;

use openraft::{CommittedLeaderId, EntryPayload};

use super::*;

fn entry(term: u64, index: u64) -> Entry {
    Entry {
        log_id: LogId::new(CommittedLeaderId::new(term, 0), index),
        payload: EntryPayload::Blank,
    }
}

fn entries(term: u64, indexes: std::ops::RangeInclusive<u64>) -> Vec<Entry> {
    indexes.map(|index| entry(term, index)).collect()
}

fn open(path: &Path, last_purged: Option<LogId>) -> LogFile {
    LogFile::open(path, last_purged, || Ok(Vec::new())).unwrap()
}

/// Why opening the log at `path` fails, with its causes.
fn open_error(path: &Path, last_purged: Option<LogId>) -> String {
    let error = LogFile::open(path, last_purged, || Ok(Vec::new())).err().unwrap();
    format!("{error:#}")
}

/// Writes entries 1..=3 of term 1 to a new log at `path`, then flips a bit of the byte at
/// `at(file length)`; returns the damaged file.
fn three_entries_with_a_flipped_bit(path: &Path, at: impl FnOnce(usize) -> usize) -> Vec<u8> {
    let mut log = open(path, None);
    log.append(&entries(1, 1..=3)).unwrap();
    drop(log);
    let mut contents = fs::read(path).unwrap();
    let byte = at(contents.len());
    contents[byte] ^= 0x20;
    fs::write(path, &contents).unwrap();
    contents
}

fn indexes(log: &LogFile) -> Vec<(u64, u64)> {
    log.read(0, None)
        .unwrap()
        .iter()
        .map(|entry| (entry.log_id.leader_id.term, entry.log_id.index))
        .collect()
}

#[test]
fn appended_entries_are_read_back_after_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("entries.log");
    let mut log = open(&path, None);
    log.append(&entries(1, 0..=3)).unwrap();
    log.append(&entries(2, 4..=6)).unwrap();
    assert_eq!(log.read(2, Some(5)).unwrap().len(), 3);
    drop(log);

    let log = open(&path, None);
    assert_eq!(
        indexes(&log),
        vec![(1, 0), (1, 1), (1, 2), (1, 3), (2, 4), (2, 5), (2, 6)]
    );
    assert_eq!(log.last_log_id(), Some(entry(2, 6).log_id));
    assert_eq!(log.read(5, None).unwrap().len(), 2);
    assert!(log.read(7, None).unwrap().is_empty());
}

#[test]
fn a_record_cut_short_by_a_crash_is_dropped_and_the_log_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("entries.log");
    let mut log = open(&path, None);
    log.append(&entries(1, 1..=5)).unwrap();
    let whole = fs::metadata(&path).unwrap().len();
    drop(log);
    // What a crash during the next append can leave: a header and part of its payload.
    let mut torn = Vec::new();
    encode(&entry(1, 6), &mut torn).unwrap();
    torn.truncate(torn.len() - 3);
    let mut file = OpenOptions::new().append(true).open(&path).unwrap();
    file.write_all(&torn).unwrap();
    drop(file);

    let mut log = open(&path, None);
    assert_eq!(log.last_log_id(), Some(entry(1, 5).log_id));
    assert_eq!(
        fs::metadata(&path).unwrap().len(),
        whole,
        "the cut-off record is gone from the file"
    );
    log.append(&entries(2, 6..=6)).unwrap();
    drop(log);
    assert_eq!(indexes(&open(&path, None)).last(), Some(&(2, 6)));
}

#[test]
fn a_garbled_last_record_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("entries.log");
    three_entries_with_a_flipped_bit(&path, |length| length - 2);
    assert_eq!(indexes(&open(&path, None)), vec![(1, 1), (1, 2)]);
}

#[test]
fn a_log_with_a_hole_or_a_foreign_header_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("entries.log");
    let mut contents = MAGIC.to_vec();
    for index in [1, 2, 4] {
        encode(&entry(1, index), &mut contents).unwrap();
    }
    fs::write(&path, &contents).unwrap();
    let error = open_error(&path, None);
    assert!(error.contains("lacks entries 3..4"), "{error}");

    // Held entries must start right after the purge point.
    let purged = Some(entry(1, 0).log_id);
    let mut intact = MAGIC.to_vec();
    encode(&entry(1, 2), &mut intact).unwrap();
    fs::write(&path, &intact).unwrap();
    let error = open_error(&path, purged);
    assert!(error.contains("lacks entries 1..2"), "{error}");

    fs::write(&path, b"not a log at all").unwrap();
    let error = open_error(&path, None);
    assert!(error.contains("not a Portcullis Raft log"), "{error}");
}

#[test]
fn an_append_that_would_leave_a_hole_is_refused_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("entries.log");
    let mut log = open(&path, None);
    log.append(&entries(1, 1..=3)).unwrap();
    let before = fs::metadata(&path).unwrap().len();
    let error = log.append(&entries(1, 5..=6)).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("entry 5 appended where the log expects entry 4"),
        "{error}"
    );
    assert_eq!(fs::metadata(&path).unwrap().len(), before);
    assert_eq!(log.last_log_id(), Some(entry(1, 3).log_id));
}

#[test]
fn truncation_and_purge_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("entries.log");
    let mut log = open(&path, None);
    log.append(&entries(1, 1..=10)).unwrap();
    log.truncate(8).unwrap();
    assert_eq!(log.last_log_id(), Some(entry(1, 7).log_id));
    log.append(&entries(2, 8..=9)).unwrap();
    let purged = entry(1, 4).log_id;
    log.purge(purged).unwrap();
    assert_eq!(
        log.read(0, Some(6)).unwrap().len(),
        1,
        "only entry 5 is held below 6"
    );
    drop(log);

    let log = open(&path, Some(purged));
    assert_eq!(indexes(&log), vec![(1, 5), (1, 6), (1, 7), (2, 8), (2, 9)]);
}

#[test]
fn a_log_purged_past_its_end_takes_the_next_index_after_the_purge() {
    // A snapshot installed beyond the log's end purges everything held.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("entries.log");
    let mut log = open(&path, None);
    log.append(&entries(1, 1..=3)).unwrap();
    let purged = entry(3, 100).log_id;
    log.purge(purged).unwrap();
    assert_eq!(log.last_log_id(), None);
    log.append(&entries(3, 50..=50)).unwrap();
    assert_eq!(log.last_log_id(), None, "an entry the snapshot covers is skipped");
    assert!(
        log.append(&entries(3, 105..=105)).is_err(),
        "a hole after the purge point"
    );
    log.append(&entries(3, 101..=102)).unwrap();
    drop(log);

    assert_eq!(indexes(&open(&path, Some(purged))), vec![(3, 101), (3, 102)]);
}

#[test]
fn purged_records_are_compacted_away_once_they_outweigh_the_held_ones() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("entries.log");
    let mut log = open(&path, None);
    log.append(&entries(1, 1..=30_000)).unwrap();
    let full = fs::metadata(&path).unwrap().len();
    assert!(full > 2 * COMPACT_MIN_BYTES, "{full} bytes");

    // Purging a little keeps the file as it is: rewriting would cost more than it frees.
    log.purge(entry(1, 100).log_id).unwrap();
    assert_eq!(fs::metadata(&path).unwrap().len(), full);

    let purged = entry(1, 29_990).log_id;
    log.purge(purged).unwrap();
    let compacted = fs::metadata(&path).unwrap().len();
    assert!(compacted < full / 1000, "{compacted} of {full} bytes left");
    // The handle in use is the new file's: appends after the compaction land in it.
    log.append(&entries(1, 30_001..=30_002)).unwrap();
    assert_eq!(log.read(29_999, None).unwrap().len(), 4);
    drop(log);

    let log = open(&path, Some(purged));
    assert_eq!(indexes(&log).first(), Some(&(1, 29_991)));
    assert_eq!(indexes(&log).last(), Some(&(1, 30_002)));
    assert!(!temporary_path(&path).exists());
}

#[test]
fn a_new_log_holds_the_initial_entries_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("entries.log");
    let log = LogFile::open(&path, None, || Ok(entries(1, 1..=2))).unwrap();
    assert_eq!(indexes(&log), vec![(1, 1), (1, 2)]);
    drop(log);
    let log = LogFile::open(&path, None, || panic!("an existing log takes no initial entries")).unwrap();
    assert_eq!(indexes(&log), vec![(1, 1), (1, 2)]);
}

#[test]
fn entries_appended_over_held_ones_replace_them_and_purged_ones_are_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("entries.log");
    let mut log = open(&path, None);
    log.append(&entries(1, 0..=5)).unwrap();
    log.append(&entries(2, 3..=4)).unwrap();
    assert_eq!(indexes(&log), [(1, 0), (1, 1), (1, 2), (2, 3), (2, 4)]);
    log.purge(LogId::new(CommittedLeaderId::new(1, 0), 1)).unwrap();
    log.append(&entries(3, 0..=3)).unwrap();
    assert_eq!(indexes(&log), [(3, 2), (3, 3)]);
    drop(log);

    let log = open(&path, Some(LogId::new(CommittedLeaderId::new(1, 0), 1)));
    assert_eq!(indexes(&log), [(3, 2), (3, 3)]);
}

#[test]
fn damage_with_records_after_it_fails_the_open_instead_of_dropping_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("entries.log");
    // A byte of the first record's payload: two whole records follow it.
    let contents = three_entries_with_a_flipped_bit(&path, |_| MAGIC.len() + HEADER_LEN as usize + 2);
    let error = open_error(&path, None);
    assert!(error.contains("damaged record"), "{error}");
    assert_eq!(fs::read(&path).unwrap(), contents, "the file is left as it was");
}

#[test]
fn a_length_flipped_past_the_end_with_records_after_it_fails_the_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("entries.log");
    // The top byte of the first record's length: it now claims 512 MiB, past the file's end,
    // as a record cut short by a crash would; two whole records follow.
    let contents = three_entries_with_a_flipped_bit(&path, |_| MAGIC.len() + 3);
    let error = open_error(&path, None);
    assert!(error.contains("damaged record at byte 8"), "{error}");
    assert_eq!(fs::read(&path).unwrap(), contents, "the file is left as it was");
}

#[test]
fn a_torn_append_with_zeros_inside_is_dropped() {
    // A crash after the length reached the disk and only some of the appended pages did: the
    // first new record reads as zeros, a later part of the append as leftover bytes.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("entries.log");
    let mut log = open(&path, None);
    log.append(&entries(1, 1..=2)).unwrap();
    drop(log);
    let mut contents = fs::read(&path).unwrap();
    let whole = contents.len() as u64;
    contents.extend_from_slice(&[0; 64]);
    contents.extend_from_slice(br#"{"log_id":{"leader_id":{"term":1,"node_id":0},"index":3},"pay"#);
    fs::write(&path, contents).unwrap();

    let log = open(&path, None);
    assert_eq!(indexes(&log), vec![(1, 1), (1, 2)]);
    assert_eq!(fs::metadata(&path).unwrap().len(), whole);
}

#[test]
fn a_zero_filled_tail_is_dropped() {
    // What a crash can leave when the file's length reached the disk and its data did not.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("entries.log");
    let mut log = open(&path, None);
    log.append(&entries(1, 1..=2)).unwrap();
    drop(log);
    let mut contents = fs::read(&path).unwrap();
    let whole = contents.len() as u64;
    contents.extend_from_slice(&[0; 100]);
    fs::write(&path, contents).unwrap();

    let log = open(&path, None);
    assert_eq!(indexes(&log), vec![(1, 1), (1, 2)]);
    assert_eq!(fs::metadata(&path).unwrap().len(), whole);
}
