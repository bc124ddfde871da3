//! Who gets a connection place (issue 27, Medium 3). A cap per address alone let 8 addresses
//! with 32 half-sent requests each take all 256 places, and `/healthz` from a ninth failed.
//! So, besides the caps overall and per address:
//! - a reserve (an eighth of the places) that connections still waiting for a request head
//!   without having shown a token never fill: past that, a newcomer takes the place of the
//!   oldest such connection of the address holding the most places, so a fresh address
//!   always gets in, and one that sends its request at once is served;
//! - near the cap (three quarters), a fair share per address of tokenless waits: the places
//!   outside the reserve divided by the addresses holding places;
//! - near the cap, a shorter header timeout (a quarter, at least 1 s) for those connections.
//!
//! Connections that are being served, or that have shown a valid token on an earlier request
//! (keep-alive), are never displaced.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

/// The bounds every connection lives within.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    /// Connections at once, overall.
    pub(super) max_connections: usize,
    /// Connections at once from one client address.
    pub(super) per_client: usize,
    /// Time to send a request head, from the connection's start or the previous response.
    pub(super) header_timeout: Duration,
    /// Time without a byte moving either way before a connection is closed.
    pub(super) idle_timeout: Duration,
}

/// Marks a response to a request that showed a valid token (or needed none): the connection
/// it came on is then never displaced by newcomers.
#[derive(Debug, Clone, Copy)]
pub(super) struct Authenticated;

/// What a connection is doing.
#[derive(Debug, Clone, Copy)]
enum State {
    /// Waiting for a request head since `since`.
    Waiting { since: Instant, trusted: bool },
    /// A request is being served.
    Serving { trusted: bool },
}

#[derive(Debug)]
struct Entry {
    client: IpAddr,
    state: State,
    /// Cancelled when the connection loses its place to a newcomer.
    displaced: CancellationToken,
}

impl Entry {
    /// Waiting for a head, without a token shown: the connections a newcomer may displace.
    fn displaceable(&self) -> Option<Instant> {
        match self.state {
            State::Waiting { since, trusted: false } => Some(since),
            _ => None,
        }
    }
}

#[derive(Debug, Default)]
struct Table {
    next_id: u64,
    conns: HashMap<u64, Entry>,
    per_client: HashMap<IpAddr, usize>,
}

impl Table {
    fn remove(&mut self, id: u64) -> Option<Entry> {
        let entry = self.conns.remove(&id)?;
        if let Some(n) = self.per_client.get_mut(&entry.client) {
            *n -= 1;
            if *n == 0 {
                self.per_client.remove(&entry.client);
            }
        }
        Some(entry)
    }

    fn displace(&mut self, id: u64) {
        if let Some(entry) = self.remove(id) {
            entry.displaced.cancel();
        }
    }

    /// The oldest displaceable connection of the address holding the most places. Even one
    /// no bigger than the newcomer's: 70 addresses of one place each took all 64 places
    /// otherwise. A client that sends its request head at once is never the oldest wait.
    fn victim(&self) -> Option<u64> {
        self.conns
            .iter()
            .filter_map(|(id, e)| e.displaceable().map(|since| (*id, e.client, since)))
            .map(|(id, client, since)| (id, self.per_client.get(&client).copied().unwrap_or(0), since))
            // Most places first, then the oldest wait (ids break ties: lower is older).
            .max_by(|a, b| a.1.cmp(&b.1).then(b.2.cmp(&a.2)).then(b.0.cmp(&a.0)))
            .map(|(id, _, _)| id)
    }
}

/// The address a connection counts against: an IPv6 client's /64, which one host is commonly
/// given whole (counted one by one, a single host would have 2^64 fair shares).
fn bucket(client: IpAddr) -> IpAddr {
    match client {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from(v6.to_bits() & !u128::from(u64::MAX))),
        },
        v4 => v4,
    }
}

/// Connections open now, and what each is doing.
#[derive(Debug)]
pub(super) struct Admission {
    limits: Limits,
    table: Mutex<Table>,
}

impl Admission {
    pub(super) fn new(limits: Limits) -> Arc<Self> {
        Arc::new(Admission { limits, table: Mutex::default() })
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Places that never hold connections waiting for a head without a token.
    fn reserve(&self) -> usize {
        (self.limits.max_connections / 8).max(usize::from(self.limits.max_connections > 1))
    }

    /// The header timeout near the cap.
    fn short_header_timeout(&self) -> Duration {
        (self.limits.header_timeout / 4).max(Duration::from_secs(1)).min(self.limits.header_timeout)
    }

    /// A place for a connection from `client`, or the flag whose limit refuses it.
    pub(super) fn admit(self: &Arc<Self>, client: IpAddr) -> Result<Place, &'static str> {
        let client = bucket(client);
        let max = self.limits.max_connections;
        let general = max - self.reserve();
        let mut t = self.table();
        let mine = t.per_client.get(&client).copied().unwrap_or(0);
        if mine >= self.limits.per_client {
            return Err("--max-connections-per-client");
        }
        if t.conns.len() * 4 >= max * 3 {
            let now = Instant::now();
            let short = self.short_header_timeout();
            let stale: Vec<u64> = (t.conns.iter())
                .filter(|(_, e)| e.displaceable().is_some_and(|since| now.duration_since(since) >= short))
                .map(|(id, _)| *id)
                .collect();
            for id in stale {
                t.displace(id);
            }
            // Shares are of tokenless waits: a client that showed a token opens its next
            // connections (an MCP client keeps a stream beside its requests) whatever it holds.
            let waiting_mine = t.conns.values().filter(|e| e.client == client && e.displaceable().is_some()).count();
            let clients = t.per_client.len() + usize::from(mine == 0);
            if waiting_mine >= (general / clients.max(1)).max(1) {
                return Err("a fair share of --max-connections");
            }
        }
        let waiting = t.conns.values().filter(|e| e.displaceable().is_some()).count();
        if t.conns.len() >= max || waiting >= general {
            match t.victim() {
                Some(id) => t.displace(id),
                None if t.conns.len() >= max => return Err("--max-connections"),
                None => {}
            }
        }
        let id = t.next_id;
        t.next_id += 1;
        let displaced = CancellationToken::new();
        let state = State::Waiting { since: Instant::now(), trusted: false };
        t.conns.insert(id, Entry { client, state, displaced: displaced.clone() });
        *t.per_client.entry(client).or_default() += 1;
        Ok(Place { admission: self.clone(), id, displaced })
    }
}

/// One admitted connection's place; given back when dropped.
#[derive(Debug)]
pub(super) struct Place {
    admission: Arc<Admission>,
    id: u64,
    displaced: CancellationToken,
}

impl Place {
    /// Fires when a newcomer took this place: the connection must close.
    pub(super) fn displaced(&self) -> &CancellationToken {
        &self.displaced
    }

    /// A request head arrived.
    pub(super) fn serving(&self) {
        if let Some(e) = self.admission.table().conns.get_mut(&self.id) {
            let trusted = matches!(e.state, State::Waiting { trusted: true, .. } | State::Serving { trusted: true });
            e.state = State::Serving { trusted };
        }
    }

    /// A response went out; the connection waits for the next head. `authenticated`: the
    /// request showed a valid token.
    pub(super) fn waiting(&self, authenticated: bool) {
        if let Some(e) = self.admission.table().conns.get_mut(&self.id) {
            let trusted = authenticated || matches!(e.state, State::Serving { trusted: true });
            e.state = State::Waiting { since: Instant::now(), trusted };
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.admission.table().remove(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_connections: usize, per_client: usize) -> Limits {
        Limits {
            max_connections,
            per_client,
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
        }
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    #[test]
    fn places_are_capped_overall_and_per_client_and_given_back() {
        let admission = Admission::new(limits(3, 2));
        let a1 = admission.admit(ip(2)).expect("a1");
        let a2 = admission.admit(ip(2)).expect("a2");
        assert_eq!(admission.admit(ip(2)).err(), Some("--max-connections-per-client"));
        a1.serving();
        a2.serving();
        let b1 = admission.admit(ip(3)).expect("b1");
        b1.serving();
        assert_eq!(admission.admit(ip(4)).err(), Some("--max-connections"), "nothing displaceable");
        drop(a1);
        assert!(admission.admit(ip(4)).is_ok(), "a closed connection gives its place back");
    }

    #[test]
    fn a_fresh_address_displaces_the_oldest_wait_of_the_biggest_holder() {
        let admission = Admission::new(limits(16, 8));
        // Two addresses fill the places outside the reserve (14 of 16) between them.
        let mut held = Vec::new();
        for _ in 0..7 {
            held.push((2, admission.admit(ip(2)).expect("a")));
            held.push((3, admission.admit(ip(3)).expect("b")));
        }
        assert_eq!(admission.admit(ip(2)).err(), Some("a fair share of --max-connections"));
        // A fresh address gets in by displacing the oldest of 127.0.0.2's (the first admitted).
        let fresh = admission.admit(ip(4)).expect("a fresh address gets a place");
        assert!(held[0].1.displaced().is_cancelled(), "the oldest waiting connection gave its place");
        assert_eq!(held.iter().filter(|(_, p)| p.displaced().is_cancelled()).count(), 1);
        // It is never the one displaced while the others hold more.
        for _ in 0..6 {
            let _ = admission.admit(ip(5));
        }
        assert!(!fresh.displaced().is_cancelled());
    }

    #[test]
    fn connections_being_served_or_authenticated_are_never_displaced() {
        let admission = Admission::new(limits(8, 8));
        let trusted = admission.admit(ip(2)).expect("trusted");
        trusted.serving();
        trusted.waiting(true);
        let busy = admission.admit(ip(2)).expect("busy");
        busy.serving();
        let mut waiting = Vec::new();
        for _ in 0..5 {
            waiting.push(admission.admit(ip(2)).expect("waiting"));
        }
        let theirs: Vec<Place> = (0..8).filter_map(|_| admission.admit(ip(3)).ok()).collect();
        assert!(!theirs.is_empty());
        assert!(!trusted.displaced().is_cancelled() && !busy.displaced().is_cancelled());
        assert!(waiting.iter().any(|p| p.displaced().is_cancelled()));
    }

    #[test]
    fn among_equal_holders_the_oldest_wait_gives_way() {
        let admission = Admission::new(limits(8, 1));
        // The 7 places outside the reserve of 1, one address each.
        let held: Vec<Place> = (2..9).map(|i| admission.admit(ip(i)).expect("one each")).collect();
        assert!(held.iter().all(|p| !p.displaced().is_cancelled()));
        let fresh = admission.admit(ip(20)).expect("a fresh address gets a place");
        assert!(held[0].displaced().is_cancelled(), "the oldest wait gave its place");
        assert_eq!(held.iter().filter(|p| p.displaced().is_cancelled()).count(), 1);
        fresh.serving();
        let _more: Vec<Place> = (30..60).filter_map(|i| admission.admit(ip(i)).ok()).collect();
        assert!(!fresh.displaced().is_cancelled(), "a connection being served stays");
    }

    #[test]
    fn a_client_that_showed_a_token_opens_more_connections_near_the_cap() {
        let admission = Admission::new(limits(8, 8));
        let mine = admission.admit(ip(1)).expect("mine");
        mine.serving();
        mine.waiting(true);
        let _others: Vec<Place> = (2..9).filter_map(|i| admission.admit(ip(i)).ok()).collect();
        // Fair share now 1 per address; ip(1) holds 1, but not a tokenless wait.
        assert!(admission.admit(ip(1)).is_ok(), "a token holder's next connection");
        assert!(!mine.displaced().is_cancelled());
    }

    #[test]
    fn an_ipv6_host_counts_as_its_64() {
        let admission = Admission::new(limits(64, 2));
        let a: IpAddr = "2001:db8:1:2::1".parse().expect("ip");
        let b: IpAddr = "2001:db8:1:2:ffff::9".parse().expect("ip");
        let other: IpAddr = "2001:db8:1:3::1".parse().expect("ip");
        let _a = admission.admit(a).expect("a");
        let _b = admission.admit(b).expect("b");
        assert_eq!(
            admission.admit("2001:db8:1:2:1:2:3:4".parse().expect("ip")).err(),
            Some("--max-connections-per-client")
        );
        assert!(admission.admit(other).is_ok(), "another /64 is another client");
        let mapped: IpAddr = "::ffff:127.0.0.2".parse().expect("ip");
        let _m = admission.admit(mapped).expect("mapped");
        let _v4 = admission.admit(ip(2)).expect("v4");
        assert_eq!(admission.admit(ip(2)).err(), Some("--max-connections-per-client"), "a mapped IPv4 is that IPv4");
    }

    #[test]
    fn near_the_cap_a_wait_is_cut_short() {
        let mut l = limits(8, 8);
        l.header_timeout = Duration::from_secs(4);
        let admission = Admission::new(l);
        assert_eq!(admission.short_header_timeout(), Duration::from_secs(1));
        let old: Vec<Place> = (0..6).map(|_| admission.admit(ip(2)).expect("old")).collect();
        // Age them past the short timeout.
        for e in admission.table().conns.values_mut() {
            e.state = State::Waiting { since: Instant::now() - Duration::from_secs(2), trusted: false };
        }
        let _new = admission.admit(ip(3)).expect("new");
        assert!(old.iter().all(|p| p.displaced().is_cancelled()), "waits past a quarter of the timeout are closed");
    }
}
