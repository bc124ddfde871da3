//! Session management and introspection: `list_sessions`, `reset_session`, `close_session`,
//! `list_variables`.

use rmcp::handler::server::common::schema_for_output;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock};
use rmcp::{tool, tool_router};

use super::error::{Context as _, ToolResult};
use super::render::structured;
use super::types::{EndedSession, NetworkPolicy, NoArgs, SessionArgs, SessionList, SetNetworkArgs, VariableList};
use super::{Caller, SandboxServer};
use crate::checks::session_name;
use crate::output::one_line;

#[tool_router(router = sessions_router, vis = "pub(super)")]
impl SandboxServer {
    /// List your open sessions with their state (running, or hibernated: saved while idle,
    /// woken by the next call), Python version, number of runs, idle time, and time until
    /// they hibernate and until they are closed for idleness.
    #[tool(annotations(title = "List sessions", read_only_hint = true), output_schema = schema_for_output::<SessionList>())]
    async fn list_sessions(&self, Parameters(_): Parameters<NoArgs>, Caller(who): Caller) -> ToolResult {
        let ended = self.registry.ended_of(&who);
        let ended = ended.into_iter().map(|(session, why, ended_s_ago)| EndedSession { session, why, ended_s_ago });
        let list = SessionList {
            sessions: self.registry.list(&who),
            max_sessions: self.cfg.max_sessions,
            ended: ended.collect(),
        };
        let mut text = format!("{} of at most {} sessions open\n", list.sessions.len(), list.max_sessions);
        for s in &list.sessions {
            let sleep = match s.hibernates_in_s {
                Some(h) => format!(", hibernates in {h} s"),
                None => String::new(),
            };
            text.push_str(&format!(
                "{}: {}, python {}, {} runs, idle {} s{sleep}, closes in {} s\n",
                s.session, s.state, s.python, s.runs, s.idle_s, s.expires_in_s
            ));
            if let Some(lost) = &s.state_lost {
                text.push_str(&format!("  its state was lost: {lost}\n"));
            }
        }
        for e in &list.ended {
            text.push_str(&format!("ended {} s ago: {:?} {}\n", e.ended_s_ago, e.session, e.why));
        }
        Ok(structured(&list, text))
    }

    /// Restart a session's interpreter: all variables, imports and running processes are
    /// discarded; files in /workspace are kept. Use it when the state is broken or to start over.
    #[tool(annotations(title = "Reset session", destructive_hint = true, idempotent_hint = true))]
    async fn reset_session(&self, Parameters(args): Parameters<SessionArgs>, Caller(who): Caller) -> ToolResult {
        let name = session_name(args.session.as_deref())?;
        let session = self.registry.get(&who, &name)?;
        let notice = session.reset().await.context(format!("cannot reset session {name:?}"))?;
        let mut text = format!("session {name:?} reset: fresh interpreter, workspace files kept");
        if let Some(n) = notice {
            text.push_str(&format!("\n[notice] {n}"));
        }
        Ok(CallToolResult::success(vec![ContentBlock::text(text)]))
    }

    /// Close a session: its container, interpreter and workspace files are deleted. A later
    /// run_python with the same name starts an empty session.
    #[tool(annotations(title = "Close session", destructive_hint = true, idempotent_hint = false))]
    async fn close_session(&self, Parameters(args): Parameters<SessionArgs>, Caller(who): Caller) -> ToolResult {
        let name = session_name(args.session.as_deref())?;
        self.registry.close(&who, &name).await?;
        Ok(CallToolResult::success(vec![ContentBlock::text(format!(
            "session {name:?} closed: its container and workspace were removed"
        ))]))
    }

    /// Narrow what a session may reach over the network from now on (its environment's
    /// egress allow-list, or a narrower one set before). Each host must be within the list in
    /// force: a caller narrows, never widens. [] makes the session offline. Affects only this
    /// caller's session.
    #[tool(annotations(title = "Set network", destructive_hint = false, idempotent_hint = true), output_schema = schema_for_output::<NetworkPolicy>())]
    async fn set_network(&self, Parameters(args): Parameters<SetNetworkArgs>, Caller(who): Caller) -> ToolResult {
        let name = session_name(args.session.as_deref())?;
        let session = self.registry.get(&who, &name)?;
        // The narrowed list is what a restarted server puts back (the session's record).
        let allow_hosts = self.registry.narrow(&session, &args.allow_hosts).await?;
        let text = match allow_hosts.is_empty() {
            true => format!("session {name:?} is offline: no host is allowed"),
            false => format!("session {name:?} may reach: {}", allow_hosts.join(", ")),
        };
        Ok(structured(&NetworkPolicy { session: name, allow_hosts }, text))
    }

    /// List the variables defined in a session (name, type and a short repr), like a
    /// notebook's variable view. Names starting with '_' and modules are left out.
    #[tool(annotations(title = "List variables", read_only_hint = true), output_schema = schema_for_output::<VariableList>())]
    async fn list_variables(&self, Parameters(args): Parameters<SessionArgs>, Caller(who): Caller) -> ToolResult {
        let name = session_name(args.session.as_deref())?;
        let session = self.registry.get(&who, &name)?;
        let (variables, notices) =
            session.variables().await.context(format!("cannot list variables of session {name:?}"))?;
        let mut text = String::new();
        for n in notices {
            text.push_str(&format!("[notice] {n}\n"));
        }
        if variables.is_empty() {
            text.push_str("no variables defined\n");
        }
        for v in &variables {
            // All three are the code's to choose: escaped, so one cannot add lines.
            text.push_str(&format!("{}: {} = {}\n", one_line(&v.name), one_line(&v.kind), one_line(&v.repr)));
        }
        Ok(structured(&VariableList { session: name, variables }, text))
    }
}
