//! This node's standing in the cluster, sampled from Raft and shared: gRPC health reports it,
//! and config streams send their proxies elsewhere when the node loses it. One task samples
//! it when Raft's metrics change (on every pass of Raft's loop) and on a timer (the age of a
//! quorum's last acknowledgement grows without an event), and wakes the others only when it
//! changes.

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::types::Raft;

/// How often the standing is sampled at least.
const SAMPLE_INTERVAL: Duration = Duration::from_millis(250);
/// A leader whose followers have acknowledged nothing for this long (with heartbeats every
/// 250 ms) is cut off: it keeps calling itself leader until it hears of a newer term, but it
/// can commit nothing.
const QUORUM_SILENCE: Duration = Duration::from_millis(1500);

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Standing {
    /// This node is in the cluster's membership (not removed, not waiting to be added).
    pub(crate) member: bool,
    /// Writes can succeed through this node: Raft runs, a leader is known and, if this node
    /// is the leader of several voters, a quorum acknowledged it within `QUORUM_SILENCE`.
    pub(crate) in_touch: bool,
}

/// Starts sampling `raft`; the task ends when the last receiver is gone.
pub(crate) fn watch(raft: Raft) -> (watch::Receiver<Standing>, JoinHandle<()>) {
    let (sender, receiver) = watch::channel(sample(&raft));
    let task = tokio::spawn(async move {
        let mut metrics = raft.metrics();
        let mut ticker = tokio::time::interval(SAMPLE_INTERVAL);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                changed = metrics.changed() => if changed.is_err() { return },
                _ = ticker.tick() => {}
            }
            if sender.is_closed() {
                return;
            }
            let now = sample(&raft);
            sender.send_if_modified(|standing| std::mem::replace(standing, now) != now);
        }
    });
    (receiver, task)
}

fn sample(raft: &Raft) -> Standing {
    let metrics = raft.metrics();
    let metrics = metrics.borrow();
    let membership = metrics.membership_config.membership();
    let member = membership.get_node(&metrics.id).is_some();
    let voters = membership.voter_ids().count();
    let quorum_heard = |ms: u64| Duration::from_millis(ms) < QUORUM_SILENCE;
    let leading = match metrics.current_leader {
        None => false,
        Some(leader) if leader == metrics.id => {
            voters <= 1 || metrics.millis_since_quorum_ack.is_some_and(quorum_heard)
        }
        Some(_) => true,
    };
    Standing {
        member,
        in_touch: metrics.running_state.is_ok() && member && leading,
    }
}
