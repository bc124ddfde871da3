//! The orderly detach of a relay (docs/design.md D12, a graceful leave), with the real
//! keeper.py and both relays (relay.pl, and keeper.py's own when perl is not there) as local
//! processes: a relay whose stdin ends writes out all it was sent, and the next relay gets the
//! rest; nothing lost, nothing twice.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

const KEEPER_PY: &str = include_str!("../../images/python/keeper.py");
const RELAY_PL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/images/python/relay.pl");
/// Lines the agent prints, as fast as it can: the keeper and the relays hold many at once.
const LINES: usize = 20_000;

/// A private scratch directory, removed at the end.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A relay started with `argv`; its stdin and stdout piped.
fn relay(argv: &[&str], dir: &Path) -> Child {
    let agent = format!("import sys\nprint('hello')\nfor i in range({LINES}):\n    print('n', i)\nsys.exit(3)");
    Command::new(argv[0])
        .args(&argv[1..])
        .args(["attach", dir.to_str().unwrap_or_default(), "--", "python3", "-u", "-c", &agent])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("python3 and perl run")
}

/// Reads `take` lines of the relay after its hello, then closes its stdin (with `None`, it
/// stays open), and reads it to its end: the lines it gave, and its exit code.
fn read(mut child: Child, take: Option<usize>) -> (Vec<String>, Option<i32>) {
    let out = child.stdout.take().expect("piped");
    let mut lines = BufReader::new(out).lines().map_while(Result::ok);
    assert_eq!(lines.next().as_deref(), Some("hello"), "each relay gets the hello first");
    let mut got: Vec<String> = Vec::new();
    if let Some(n) = take {
        got.extend(lines.by_ref().take(n));
        // The server leaves: the exec's stdin ends.
        drop(child.stdin.take());
    }
    got.extend(lines);
    let code = child.wait().expect("the relay ends").code();
    (got, code)
}

#[test]
fn a_relay_whose_stdin_ends_delivers_what_it_was_sent_and_the_next_gets_the_rest() {
    let root = std::env::temp_dir().join(format!("pyberth-relay-{}", std::process::id()));
    let scratch = Scratch(root.clone());
    // keeper.py alone, without relay.pl beside it: it relays itself (its relay()).
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin).expect("scratch");
    let keeper = bin.join("keeper.py");
    std::fs::write(&keeper, KEEPER_PY).expect("keeper.py");
    let keeper = keeper.to_str().unwrap_or_default().to_owned();
    let dir = root.join("k");
    let python = ["python3", "-I", "-S", "-B", keeper.as_str()];

    // The first attach starts the keeper; its relay (Python's) leaves early.
    let (first, code) = read(relay(&python, &dir), Some(100));
    assert_eq!(code, Some(0), "a relay that let go in order exits 0");
    // A perl relay reaches the same keeper, and leaves too.
    let (second, code) = read(relay(&["perl", RELAY_PL], &dir), Some(100));
    assert_eq!(code, Some(0), "a relay that let go in order exits 0");
    // The last reads to the agent's end, and its status.
    let (third, code) = read(relay(&python, &dir), None);
    assert_eq!(code, Some(3), "the agent's status");

    assert!(first.len() >= 100 && second.len() >= 100, "each relay delivered what it read");
    let all: Vec<String> = first.into_iter().chain(second).chain(third).collect();
    let want: Vec<String> = (0..LINES).map(|i| format!("n {i}")).collect();
    let lost = want.iter().filter(|w| !all.contains(w)).count();
    assert_eq!(lost, 0, "lines lost across the detaches ({} read)", all.len());
    assert!(all == want, "every line once, in order ({} read)", all.len());
    drop(scratch);
}
