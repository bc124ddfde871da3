//! `pyberth run` in code mode (issue 30): when the environment lets its sessions call upstream
//! tools, a script runs in the sandbox's persistent interpreter (the one that holds the agent
//! channel `tools` talks over) instead of a fresh `python` process, so `import tools` works
//! there under the same checks, budget and audit as a session's `run_python`.
//!
//! The script runs as `python script.py` would, through `runpy.run_path(..., "__main__")`:
//! `sys.argv` is the script's path and arguments, its directory is first on `sys.path`, no
//! bytecode is written, an uncaught exception prints its traceback (from the script's first
//! frame on) and exits 1, `sys.exit("text")` prints the text and exits 1. What differs: the
//! run ends when the script's main thread does (other threads are not waited for), and
//! `atexit` handlers do not run, since the interpreter does not exit.

/// The code that runs the workspace script `rel` with `args` in the agent's interpreter.
pub(super) fn in_process(rel: &str, args: &[String]) -> String {
    // JSON strings are Python string literals; serde_json cannot fail on strings.
    let lit = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "''".into());
    let args: Vec<String> = args.iter().map(|a| lit(a)).collect();
    format!(
        r#"def __pyberth_main():
    import os, runpy, sys, traceback
    path = os.path.join(os.environ.get("PYBERTH_WORKSPACE", "/workspace"), {rel})
    sys.argv = [path, {args}]
    sys.path.insert(0, os.path.dirname(path))
    sys.dont_write_bytecode = True
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            raise
        print(e.code, file=sys.stderr)
        raise SystemExit(1) from None
    except Exception as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        raise SystemExit(1) from None
__pyberth_main()
"#,
        rel = lit(rel),
        args = args.join(", "),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_arguments_reach_python_as_literals_never_as_code() {
        let code = in_process("a\".py", &["x\"); import os; (\"".into(), "\n".into()]);
        assert!(code.contains(r#""a\".py""#), "{code}");
        assert!(code.contains(r#"sys.argv = [path, "x\"); import os; (\"", "\n"]"#), "{code}");
        assert!(in_process("s.py", &[]).contains("sys.argv = [path, ]"));
    }
}
