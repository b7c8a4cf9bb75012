//! A small network of Linux network namespaces for partitions. Each node lives in its own
//! namespace with two links:
//! - the cluster link, a veth to a bridge all nodes share: the address nodes know each other
//!   by, and the one a partition cuts (its bridge end is set down, so the node hears no node
//!   and no node hears it);
//! - the client link, a point-to-point veth to the test, never cut, so a partitioned node
//!   still answers clients as a real minority would (an old leader keeps taking writes it
//!   cannot commit).
//!
//! Needs root and `ip` (iproute2), as on the CI machines. Labs on one machine take turns
//! (an exclusive lock on a file under the temporary directory), so a lab may remove what a
//! killed run left behind without touching a live one. On a host whose firewall filters
//! bridged traffic (`br_netfilter` with a FORWARD policy of DROP, as Docker sets up), the
//! nodes cannot reach each other and the test fails waiting for them.

use std::process::Command;

/// The cluster network (a /24 behind the bridge) and the client links (one /30 per node).
const CLUSTER_NET: &str = "10.213.1";
const CLIENT_NET: &str = "10.213.2";

pub struct Lab {
    tag: String,
    nodes: usize,
    /// Held while the lab exists: released (by the kernel, also when the run is killed)
    /// with it.
    _turn: std::fs::File,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let output = Command::new("ip")
        .args(args)
        .output()
        .map_err(|error| format!("running ip {}: {error} (is iproute2 installed?)", args.join(" ")))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {} (network namespaces need root)",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

impl Lab {
    pub fn create(nodes: usize) -> Result<Lab, String> {
        let path = std::env::temp_dir().join("portcullis-chaos-lab.lock");
        let turn = std::fs::File::create(&path).map_err(|error| format!("{}: {error}", path.display()))?;
        turn.lock()
            .map_err(|error| format!("locking {}: {error}", path.display()))?;
        remove_leftovers();
        let lab = Lab {
            tag: format!("{:x}", std::process::id() % 0xffff),
            nodes,
            _turn: turn,
        };
        ip(&["link", "add", &lab.bridge(), "type", "bridge"])?;
        ip(&["link", "set", &lab.bridge(), "up"])?;
        for node in 0..nodes {
            let namespace = lab.namespace(node);
            ip(&["netns", "add", &namespace])?;
            ip(&["-n", &namespace, "link", "set", "lo", "up"])?;
            // Cluster link: `cl<tag>-<n>` on the bridge, `cluster` in the namespace.
            let outside = lab.cluster_veth(node);
            ip(&[
                "link", "add", &outside, "type", "veth", "peer", "name", "cluster", "netns", &namespace,
            ])?;
            ip(&["link", "set", &outside, "master", &lab.bridge(), "up"])?;
            let address = format!("{}/24", lab.cluster_ip(node));
            ip(&["-n", &namespace, "addr", "add", &address, "dev", "cluster"])?;
            ip(&["-n", &namespace, "link", "set", "cluster", "up"])?;
            // Client link: the test's end gets .4n+1, the node's .4n+2.
            let outside = lab.client_veth(node);
            ip(&[
                "link", "add", &outside, "type", "veth", "peer", "name", "client", "netns", &namespace,
            ])?;
            ip(&[
                "addr",
                "add",
                &format!("{CLIENT_NET}.{}/30", 4 * node + 1),
                "dev",
                &outside,
            ])?;
            ip(&["link", "set", &outside, "up"])?;
            let address = format!("{}/30", lab.client_ip(node));
            ip(&["-n", &namespace, "addr", "add", &address, "dev", "client"])?;
            ip(&["-n", &namespace, "link", "set", "client", "up"])?;
        }
        Ok(lab)
    }

    fn bridge(&self) -> String {
        format!("pcb{}", self.tag)
    }

    fn cluster_veth(&self, node: usize) -> String {
        format!("pcc{}-{node}", self.tag)
    }

    fn client_veth(&self, node: usize) -> String {
        format!("pcl{}-{node}", self.tag)
    }

    pub fn namespace(&self, node: usize) -> String {
        format!("portcullis-chaos-{}-{node}", self.tag)
    }

    /// The command prefix that runs a program inside the node's namespace.
    pub fn wrapper(&self, node: usize) -> Vec<String> {
        ["ip", "netns", "exec", &self.namespace(node)]
            .map(String::from)
            .to_vec()
    }

    /// The address the other nodes reach `node` at.
    pub fn cluster_ip(&self, node: usize) -> String {
        format!("{CLUSTER_NET}.{}", node + 1)
    }

    /// The address the test reaches `node` at.
    pub fn client_ip(&self, node: usize) -> String {
        format!("{CLIENT_NET}.{}", 4 * node + 2)
    }

    /// Cuts `node` off from every other node (clients still reach it).
    pub fn partition(&self, node: usize) {
        ip(&["link", "set", &self.cluster_veth(node), "down"]).expect("partition");
    }

    pub fn heal(&self, node: usize) {
        ip(&["link", "set", &self.cluster_veth(node), "up"]).expect("heal");
    }
}

/// Removes what a run that could not clean up (killed mid-way) left: its nodes, and its
/// links, which would keep the addresses every run uses. Called holding the lab lock, so
/// whatever it finds belongs to no live lab.
fn remove_leftovers() {
    let listed = |args: &[&str]| {
        Command::new("ip")
            .args(args)
            .output()
            .map(|output| String::from_utf8_lossy(&output.stdout).into_owned())
            .unwrap_or_default()
    };
    for line in listed(&["-o", "link", "show"]).lines() {
        let Some(name) = line.split(": ").nth(1).and_then(|name| name.split('@').next()) else {
            continue;
        };
        let ours = ["pcb", "pcc", "pcl"].iter().any(|prefix| {
            name.strip_prefix(prefix)
                .and_then(|rest| rest.chars().next())
                .is_some_and(|first| first.is_ascii_hexdigit())
        });
        if ours {
            let _ = ip(&["link", "del", name]);
        }
    }
    for line in listed(&["netns", "list"]).lines() {
        if let Some(namespace) = line
            .split_whitespace()
            .next()
            .filter(|name| name.starts_with("portcullis-chaos-"))
        {
            // Nodes orphaned by the killed run.
            for pid in listed(&["netns", "pids", namespace]).split_whitespace() {
                let _ = Command::new("kill").args(["-KILL", pid]).status();
            }
            let _ = ip(&["netns", "del", namespace]);
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        // The links go first, by name: a deleted namespace lives on (with its links and
        // their addresses) while sockets of its dead processes linger in TIME_WAIT, and
        // the next run would route to it. Deleting one end of a veth deletes both.
        for node in 0..self.nodes {
            let _ = ip(&["link", "del", &self.cluster_veth(node)]);
            let _ = ip(&["link", "del", &self.client_veth(node)]);
            let _ = ip(&["netns", "del", &self.namespace(node)]);
        }
        let _ = ip(&["link", "del", &self.bridge()]);
    }
}
