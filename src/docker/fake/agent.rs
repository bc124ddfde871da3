//! The fake engine's agent: speaks the agent protocol (docs/agent-protocol.md, version
//! [`PROTOCOL_VERSION`]) over an attached exec, well enough for what the owners do with a
//! session: hello, `ack`, a run of a tiny Python subset (`name = literal`, `print(...)`, a
//! final expression, `a + b`), variables, attach, packages, workspace files, and the stream
//! snapshot and restore of a hibernation (its "pickle" is JSON).
//!
//! The interpreter ([`Interp`]) lives in the container, as the real agent lives under its
//! keeper: a new attach reaches the same one until it is killed or its container goes.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use base64::Engine as _;
use bollard::container::LogOutput;
use bytes::Bytes;
use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::World;
use crate::docker::snapshot::{RESTORE_DIR, SAVE_DIR};
use crate::protocol::{NOTHING_SAVED, PROTOCOL_VERSION};

/// The Python version every fake agent says it runs.
pub(crate) const PYTHON: &str = "3.12.0";

/// A value of the subset.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Val {
    /// An `int`.
    Int(i64),
    /// A `str`.
    Str(String),
}

impl Val {
    fn repr(&self) -> String {
        match self {
            Val::Int(i) => i.to_string(),
            Val::Str(s) => format!("'{s}'"),
        }
    }
    fn show(&self) -> String {
        match self {
            Val::Int(i) => i.to_string(),
            Val::Str(s) => s.clone(),
        }
    }
    fn kind(&self) -> &'static str {
        match self {
            Val::Int(_) => "int",
            Val::Str(_) => "str",
        }
    }
    fn to_json(&self) -> Value {
        match self {
            Val::Int(i) => json!(i),
            Val::Str(s) => json!(s),
        }
    }
    fn from_json(v: &Value) -> Option<Val> {
        v.as_i64().map(Val::Int).or_else(|| v.as_str().map(|s| Val::Str(s.to_owned())))
    }
}

/// One interpreter in a container: its pid, its variables, and the token that kills it.
#[derive(Debug)]
pub(crate) struct Interp {
    pub(crate) pid: u32,
    pub(crate) vars: Mutex<BTreeMap<String, Val>>,
    pub(crate) stop: CancellationToken,
}

impl Interp {
    pub(crate) fn new(pid: u32) -> Arc<Self> {
        Arc::new(Self { pid, vars: Mutex::default(), stop: CancellationToken::new() })
    }
}

/// What a run raised: the exception's type and message.
type Raised = (String, String);

fn eval(expr: &str, vars: &BTreeMap<String, Val>) -> Result<Val, Raised> {
    let expr = expr.trim();
    if let Some((a, b)) = split_plus(expr) {
        return match (eval(a, vars)?, eval(b, vars)?) {
            (Val::Int(x), Val::Int(y)) => Ok(Val::Int(x.wrapping_add(y))),
            (Val::Str(x), Val::Str(y)) => Ok(Val::Str(x + &y)),
            _ => Err(("TypeError".into(), "unsupported operand type(s) for +".into())),
        };
    }
    if let Ok(i) = expr.parse::<i64>() {
        return Ok(Val::Int(i));
    }
    for q in ['\'', '"'] {
        if let Some(s) = expr.strip_prefix(q).and_then(|r| r.strip_suffix(q)) {
            return Ok(Val::Str(s.to_owned()));
        }
    }
    if is_name(expr) {
        return vars.get(expr).cloned().ok_or_else(|| ("NameError".into(), format!("name '{expr}' is not defined")));
    }
    Err(("SyntaxError".into(), format!("the fake agent cannot evaluate {expr:?}")))
}

/// `a + b` at the last `+` outside quotes.
fn split_plus(expr: &str) -> Option<(&str, &str)> {
    let mut quote = None;
    let mut at = None;
    for (i, c) in expr.char_indices() {
        match (quote, c) {
            (None, '\'' | '"') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, '+') => at = Some(i),
            _ => {}
        }
    }
    at.map(|i| (&expr[..i], &expr[i + 1..]))
}

fn is_name(s: &str) -> bool {
    s.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Runs `code`: what it printed, the repr of a final expression, or what it raised.
fn run(code: &str, vars: &mut BTreeMap<String, Val>) -> (String, Option<String>, Option<Raised>) {
    let mut out = String::new();
    let statements: Vec<&str> = code.split(['\n', ';']).map(str::trim).filter(|s| !s.is_empty()).collect();
    let mut result = None;
    for (i, s) in statements.iter().enumerate() {
        let done = if let Some(args) = s.strip_prefix("print(").and_then(|r| r.strip_suffix(')')) {
            let shown: Result<Vec<String>, Raised> =
                args.split(',').filter(|a| !a.trim().is_empty()).map(|a| eval(a, vars).map(|v| v.show())).collect();
            shown.map(|s| {
                out.push_str(&s.join(" "));
                out.push('\n');
            })
        } else if let Some((name, value)) = s.split_once('=').filter(|(n, _)| is_name(n.trim())) {
            eval(value, vars).map(|v| {
                vars.insert(name.trim().to_owned(), v);
            })
        } else {
            eval(s, vars).map(|v| {
                if i + 1 == statements.len() {
                    result = Some(v.repr());
                }
            })
        };
        if let Err(raised) = done {
            return (out, None, Some(raised));
        }
    }
    (out, result, None)
}

/// One attached connection to `interp` in `container`: requests from `input`, events into
/// `tx`. Ends when the server drops the connection (its stdin closes) or the interpreter is
/// killed; dropping `tx` then ends the exec's output, as a dying relay's does.
pub(super) async fn serve(
    world: Arc<Mutex<World>>,
    container: String,
    interp: Arc<Interp>,
    input: tokio::io::DuplexStream,
    tx: mpsc::Sender<Result<LogOutput, bollard::errors::Error>>,
) {
    let agent = Agent { world, container, interp, tx };
    if !agent
        .send(json!({"ev": "hello", "protocol": PROTOCOL_VERSION, "python": PYTHON, "pid": agent.interp.pid}))
        .await
    {
        return;
    }
    let mut lines = tokio::io::BufReader::new(input).lines();
    loop {
        let line = tokio::select! {
            biased;
            () = agent.interp.stop.cancelled() => return,
            line = lines.next_line() => line,
        };
        let Ok(Some(line)) = line else { return };
        let Ok(req) = serde_json::from_str::<Value>(&line) else {
            continue; // the real agent logs an unreadable request on its stderr
        };
        if !agent.handle(&req).await {
            return;
        }
    }
}

struct Agent {
    world: Arc<Mutex<World>>,
    container: String,
    interp: Arc<Interp>,
    tx: mpsc::Sender<Result<LogOutput, bollard::errors::Error>>,
}

impl Agent {
    async fn send(&self, ev: Value) -> bool {
        let mut line = ev.to_string().into_bytes();
        line.push(b'\n');
        self.tx.send(Ok(LogOutput::StdOut { message: Bytes::from(line) })).await.is_ok()
    }

    /// The workspace of the container, changed by `f`; `None` when it has none (gone).
    fn workspace<T>(&self, f: impl FnOnce(&mut super::files::Files) -> T) -> Option<T> {
        let mut world = self.world.lock().unwrap_or_else(|e| e.into_inner());
        world.workspace(&self.container).map(f)
    }

    fn vars(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Val>> {
        self.interp.vars.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Answers one request; false when the connection is gone.
    async fn handle(&self, req: &Value) -> bool {
        let op = req["op"].as_str().unwrap_or_default();
        let Some(id) = req["id"].as_u64() else { return true };
        if op == "interrupt" {
            return true; // nothing of the subset runs long enough to interrupt
        }
        if !self.send(json!({"ev": "ack", "id": id})).await {
            return false;
        }
        let answers = match op {
            "run" => self.run(id, req["code"].as_str().unwrap_or_default()),
            "vars" => {
                let vars: Vec<Value> =
                    self.vars().iter().map(|(n, v)| json!({"name": n, "type": v.kind(), "repr": v.repr()})).collect();
                vec![json!({"ev": "vars", "id": id, "vars": vars})]
            }
            "attach" => vec![json!({"ev": "attached", "id": id, "missing": []})],
            "packages" => vec![json!({"ev": "packages", "id": id, "packages": []})],
            "save_state" => vec![json!({"ev": "saved", "id": id, "small": true})],
            "snapshot" => self.snapshot(id),
            "restore" => vec![self.restore(id, req["if_saved"].as_bool().unwrap_or(false))],
            "write" | "read" | "list" | "delete" => vec![self.file(id, op, req)],
            _ => vec![json!({"ev": "failed", "id": id, "message": format!("unknown op {op:?}")})],
        };
        for ev in answers {
            if !self.send(ev).await {
                return false;
            }
        }
        true
    }

    fn run(&self, id: u64, code: &str) -> Vec<Value> {
        let (out, result, raised) = run(code, &mut self.vars());
        let mut evs = Vec::new();
        if !out.is_empty() {
            evs.push(json!({"ev": "out", "id": id, "s": "stdout", "t": out}));
        }
        let mut done = json!({"ev": "done", "id": id, "status": "ok", "result": result, "wall_ms": 0.1, "cpu_ms": 0.1});
        if let Some((kind, message)) = raised {
            done["status"] = json!("error");
            let traceback = format!("Traceback (most recent call last):\n{kind}: {message}\n");
            done["error"] = json!({"type": kind, "message": message, "traceback": traceback});
        }
        evs.push(done);
        evs
    }

    fn file(&self, id: u64, op: &str, req: &Value) -> Value {
        let failed = |message: String| json!({"ev": "failed", "id": id, "message": message});
        let Some(path) = req["path"].as_str().and_then(super::files::key) else {
            return failed("a path outside the workspace".into());
        };
        let answer = self.workspace(|ws| match op {
            "write" => {
                let data = base64::engine::general_purpose::STANDARD.decode(req["b"].as_str().unwrap_or_default());
                let Ok(data) = data else { return failed("bad base64".into()) };
                let size = ws.write(&path, &data, req["append"].as_bool().unwrap_or(false));
                json!({"ev": "file", "id": id, "size": size})
            }
            "read" => match ws.files.get(&path) {
                Some(data) => {
                    let from = usize::try_from(req["offset"].as_u64().unwrap_or(0)).unwrap_or(usize::MAX);
                    let len = usize::try_from(req["length"].as_u64().unwrap_or(0)).unwrap_or(usize::MAX);
                    let part = data.get(from.min(data.len())..from.saturating_add(len).min(data.len())).unwrap_or(&[]);
                    let b = base64::engine::general_purpose::STANDARD.encode(part);
                    json!({"ev": "file", "id": id, "size": data.len(), "b": b})
                }
                None => failed(format!("no such file: {path}")),
            },
            "list" if ws.is_dir(&path) => {
                let entries: Vec<Value> = ws
                    .list(&path, req["recursive"].as_bool().unwrap_or(false))
                    .into_iter()
                    .map(|(p, size, kind)| json!({"path": p, "size": size, "kind": kind}))
                    .collect();
                json!({"ev": "file", "id": id, "entries": entries, "truncated": false})
            }
            "list" => failed(format!("not a directory: {path}")),
            _ if path.is_empty() => failed("the workspace itself cannot be deleted".into()),
            _ if ws.delete(&path) => json!({"ev": "file", "id": id, "size": 0}),
            _ => failed(format!("no such file: {path}")),
        });
        answer.unwrap_or_else(|| failed("the workspace is gone".into()))
    }

    /// The state and the workspace as one tar (`state/meta.json`, `state/values.pkl`,
    /// `workspace/...`), in one piece.
    fn snapshot(&self, id: u64) -> Vec<Value> {
        let vars: serde_json::Map<String, Value> = self.vars().iter().map(|(n, v)| (n.clone(), v.to_json())).collect();
        let names: Vec<&String> = vars.keys().collect();
        let meta = json!({"saved": names, "lost": []}).to_string();
        let values = Value::Object(vars.clone()).to_string();
        let packed = self.workspace(|ws| {
            let mut tree = super::files::Files::default();
            tree.files.insert("state/meta.json".into(), meta.into_bytes());
            tree.files.insert("state/values.pkl".into(), values.into_bytes());
            tree.dirs.insert("workspace".into());
            for (p, data) in ws.files.iter().filter(|(p, _)| !p.starts_with(SAVE_DIR)) {
                tree.files.insert(format!("workspace/{p}"), data.clone());
            }
            for d in &ws.dirs {
                tree.dirs.insert(format!("workspace/{d}"));
            }
            tree.pack("", "")
        });
        match packed {
            Some(Ok(tar)) => {
                let b = base64::engine::general_purpose::STANDARD.encode(&tar);
                vec![
                    json!({"ev": "file", "id": id, "more": true, "b": b}),
                    json!({"ev": "file", "id": id, "size": tar.len()}),
                ]
            }
            Some(Err(e)) => vec![json!({"ev": "failed", "id": id, "message": e})],
            None => vec![json!({"ev": "failed", "id": id, "message": "the workspace is gone"})],
        }
    }

    /// Loads the variables the server unpacked into [`RESTORE_DIR`], then removes it.
    fn restore(&self, id: u64, if_saved: bool) -> Value {
        let saved = self.workspace(|ws| {
            let values = ws.files.get(&format!("{RESTORE_DIR}/values.pkl")).cloned();
            ws.delete(RESTORE_DIR);
            values
        });
        let Some(Some(values)) = saved else {
            let message = if if_saved { NOTHING_SAVED.to_owned() } else { "no saved state".to_owned() };
            return json!({"ev": "failed", "id": id, "message": message});
        };
        let Ok(Value::Object(values)) = serde_json::from_slice::<Value>(&values) else {
            return json!({"ev": "failed", "id": id, "message": "unreadable state"});
        };
        let mut vars = self.vars();
        let mut restored = Vec::new();
        for (name, v) in values {
            if let Some(v) = Val::from_json(&v) {
                vars.insert(name.clone(), v);
                restored.push(name);
            }
        }
        json!({"ev": "restored", "id": id, "restored": restored, "lost": []})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_subset_assigns_prints_adds_and_raises() {
        let mut vars = BTreeMap::new();
        let (out, result, raised) = run("x = 40\ny = x + 2\nprint('y is', y)\ny", &mut vars);
        assert_eq!((out.as_str(), result.as_deref(), raised), ("y is 42\n", Some("42"), None));
        let (_, _, raised) = run("nope + 1", &mut vars);
        assert_eq!(raised.map(|r| r.0).as_deref(), Some("NameError"));
        assert_eq!(run("s = 'a+b'; s", &mut vars).1.as_deref(), Some("'a+b'"));
    }
}
