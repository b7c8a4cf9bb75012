//! The record of every operation a chaos run made, and the check of what a linearizable
//! config store must show in it (versions only move forward, for writes and for reads). Each
//! recorded write creates an object of its own, so a read shows exactly which writes it saw;
//! writes of objects that refer to each other are not recorded one by one, but no read may
//! show a reference to an object it does not hold.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::Instant;

pub struct Write {
    pub name: String,
    pub ended: Instant,
    /// The config version the write was acknowledged at; `None` when it failed or timed out
    /// (it may still have been applied).
    pub acked: Option<u64>,
}

pub struct Read {
    pub started: Instant,
    pub ended: Instant,
    /// `None` when the read failed.
    pub result: Option<Observed>,
}

/// What one read of the whole config showed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    pub version: u64,
    /// The objects the recorded writes create.
    pub names: BTreeSet<String>,
    /// What no valid config holds (a Route referring to an object the read does not hold),
    /// described.
    pub broken: Vec<String>,
}

/// Who a node said led, in which term, as seen by polling every node's status.
pub struct Leadership {
    pub node: u64,
    pub term: u64,
    pub leader: Option<u64>,
}

#[derive(Default, Debug)]
pub struct Report {
    pub writes: usize,
    pub acked: usize,
    /// Acknowledged at a version another acknowledged write shares: committed in one entry.
    pub acked_together: usize,
    pub failed_writes: usize,
    pub reads: usize,
    pub failed_reads: usize,
    pub terms: usize,
    pub violations: Vec<String>,
}

/// Checks the history. `last` is a linearizable read taken after the faults stopped.
pub fn check(writes: &[Write], reads: &[Read], leadership: &[Leadership], last: &Observed) -> Report {
    let mut report = Report {
        writes: writes.len(),
        acked: writes.iter().filter(|write| write.acked.is_some()).count(),
        failed_writes: writes.iter().filter(|write| write.acked.is_none()).count(),
        reads: reads.len(),
        failed_reads: reads.iter().filter(|read| read.result.is_none()).count(),
        ..Report::default()
    };
    let acked: Vec<(&Write, u64)> = writes
        .iter()
        .filter_map(|write| Some((write, write.acked?)))
        .collect();
    let mut per_version: BTreeMap<u64, usize> = BTreeMap::new();
    for (_, version) in &acked {
        *per_version.entry(*version).or_default() += 1;
    }
    report.acked_together = per_version.values().filter(|count| **count > 1).sum();

    // No acknowledged write lost.
    for (write, version) in &acked {
        if !last.names.contains(&write.name) {
            report.violations.push(format!(
                "acknowledged write {} (version {version}) lost",
                write.name
            ));
        }
    }
    // Nothing broken in the last read either (the reads below are checked alike).
    for problem in &last.broken {
        report
            .violations
            .push(format!("the last read, at version {}: {problem}", last.version));
    }
    let written: HashSet<&str> = writes.iter().map(|write| write.name.as_str()).collect();
    // No read older than a write acknowledged before it began.
    for read in reads {
        let Some(Observed {
            version,
            names,
            broken,
        }) = &read.result
        else {
            continue;
        };
        // A reference to nothing: a write applied on a config it was not validated on.
        for problem in broken {
            report
                .violations
                .push(format!("read at version {version}: {problem}"));
        }
        for (write, written_at) in &acked {
            if write.ended < read.started && (!names.contains(&write.name) || version < written_at) {
                report.violations.push(format!(
                    "read at version {version} misses {} acknowledged at version {written_at} before it began",
                    write.name
                ));
            } else if written_at <= version && !names.contains(&write.name) {
                // Writes committed in one entry share a version; a config at that version
                // or later holds every one of them. Two leaders committing different writes
                // on one base would show here (and as a lost write).
                report.violations.push(format!(
                    "read at version {version} lacks {}, acknowledged at version {written_at}",
                    write.name
                ));
            }
        }
        for name in names {
            if !written.contains(name.as_str()) {
                report
                    .violations
                    .push(format!("read shows {name}, never written"));
            }
        }
        // Nor older than a read that ended before it began.
        for earlier in reads {
            if let Some(seen) = &earlier.result {
                if earlier.ended < read.started && seen.version > *version {
                    report.violations.push(format!(
                        "read at version {version} began after a read at version {} ended",
                        seen.version
                    ));
                }
            }
        }
    }
    // Never two leaders in one term.
    let mut leaders: BTreeMap<u64, BTreeSet<u64>> = BTreeMap::new();
    for seen in leadership {
        if seen.leader == Some(seen.node) {
            leaders.entry(seen.term).or_default().insert(seen.node);
        }
    }
    report.terms = leaders.len();
    for (term, nodes) in &leaders {
        if nodes.len() > 1 {
            report
                .violations
                .push(format!("nodes {nodes:?} each led term {term}"));
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn at(base: Instant, millis: u64) -> Instant {
        base + Duration::from_millis(millis)
    }

    fn write(base: Instant, name: &str, ended: u64, acked: Option<u64>) -> Write {
        Write {
            name: name.into(),
            ended: at(base, ended),
            acked,
        }
    }

    fn observed(version: u64, names: &[&str]) -> Observed {
        Observed {
            version,
            names: names.iter().map(|name| name.to_string()).collect(),
            broken: Vec::new(),
        }
    }

    fn read(base: Instant, started: u64, version: u64, names: &[&str]) -> Read {
        Read {
            started: at(base, started),
            ended: at(base, started + 2),
            result: Some(observed(version, names)),
        }
    }

    #[test]
    fn a_clean_history_has_no_violations() {
        let base = Instant::now();
        // `a` and `c` committed in one entry.
        let writes = [
            write(base, "a", 10, Some(1)),
            write(base, "c", 12, Some(1)),
            write(base, "b", 30, None),
        ];
        // A read begun before the first write was acknowledged need not see it.
        let reads = [read(base, 5, 0, &[]), read(base, 15, 1, &["a", "c"])];
        let report = check(&writes, &reads, &[], &observed(2, &["a", "b", "c"]));
        assert!(report.violations.is_empty(), "{:?}", report.violations);
        assert_eq!(
            (report.acked, report.acked_together, report.failed_writes),
            (2, 2, 1)
        );
    }

    #[test]
    fn a_lost_write_a_stale_read_a_split_version_two_leaders_and_a_dangling_reference_are_caught() {
        let base = Instant::now();
        let writes = [write(base, "a", 10, Some(1)), write(base, "b", 30, Some(1))];
        let mut pointing_nowhere = read(base, 60, 2, &["a"]);
        if let Some(seen) = &mut pointing_nowhere.result {
            seen.broken
                .push("Route/r refers to Backend/gone, which the read does not hold".into());
        }
        let reads = [
            read(base, 15, 0, &[]),
            // Begun before b was acknowledged, at the version b was acknowledged at.
            read(base, 20, 1, &["a"]),
            read(base, 40, 2, &["a"]),
            read(base, 50, 1, &["a"]),
            pointing_nowhere,
        ];
        let leadership = [
            Leadership {
                node: 1,
                term: 4,
                leader: Some(1),
            },
            Leadership {
                node: 2,
                term: 4,
                leader: Some(2),
            },
        ];
        let report = check(&writes, &reads, &leadership, &observed(1, &["a"]));
        let violations = report.violations.join("\n");
        assert!(
            violations.contains("acknowledged write b (version 1) lost"),
            "{violations}"
        );
        assert!(
            violations.contains("read at version 1 lacks b, acknowledged at version 1"),
            "{violations}"
        );
        assert!(violations.contains("read at version 0 misses a"), "{violations}");
        assert!(violations.contains("each led term 4"), "{violations}");
        assert!(
            violations.contains("read at version 2: Route/r refers to Backend/gone"),
            "{violations}"
        );
        assert!(
            violations.contains("read at version 1 began after a read at version 2 ended"),
            "{violations}"
        );
    }
}
