//! `list_bridged_tools`: which upstream MCP tools code in an environment's sessions may call
//! (code mode, issue 30), and how, in the model's words.

use rmcp::handler::server::common::schema_for_output;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::{tool, tool_router};
use serde::{Deserialize, Serialize};

use super::error::ToolResult;
use super::render::structured;
use super::{Caller, SandboxServer};

/// Arguments of `list_bridged_tools`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct BridgedArgs {
    /// Environment whose sessions are asked about; default: the default environment.
    #[serde(default)]
    pub environment: Option<String>,
}

/// One tool code may call.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub(crate) struct BridgedTool {
    /// How Python calls it: `tools.SERVER.TOOL`.
    pub call: String,
    /// First line of its description.
    pub summary: String,
    /// Whether it may be called: false for a tool not marked read-only that the operator has
    /// not allowed by name.
    pub callable: bool,
}

/// Structured result of `list_bridged_tools`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub(crate) struct BridgedList {
    /// Environment.
    pub environment: String,
    /// The tools, by `call`.
    pub tools: Vec<BridgedTool>,
    /// Upstreams that could not be reached, with why.
    pub unavailable: Vec<(String, String)>,
    /// Calls one run may make.
    pub calls_per_run: u32,
    /// Seconds one run's calls may take together.
    pub call_time_per_run_s: u64,
}

#[tool_router(router = bridged_router, vis = "pub(super)")]
impl SandboxServer {
    /// List the operator's MCP tools that Python code in run_python may call (code mode):
    /// `import tools`, then `tools.SERVER.TOOL(arg=...)` returns the tool's structured result
    /// as Python data. Filter and combine results in code and print only what you need, in
    /// one run_python call, instead of calling tools one by one. `tools.search("words")` and
    /// `tools.describe("server.tool")` show signatures inside the sandbox.
    #[tool(annotations(title = "List bridged tools", read_only_hint = true), output_schema = schema_for_output::<BridgedList>())]
    async fn list_bridged_tools(&self, Parameters(args): Parameters<BridgedArgs>, Caller(who): Caller) -> ToolResult {
        let env = self.registry.environments.get(args.environment.as_deref())?;
        let policy = &self.registry.bridge.narrowed(&env.bridge, &who);
        if policy.allow.is_empty() {
            let out = BridgedList {
                environment: env.name.clone(),
                tools: Vec::new(),
                unavailable: Vec::new(),
                calls_per_run: 0,
                call_time_per_run_s: 0,
            };
            let text = format!(
                "Code mode is off in environment {}: the operator allows its sessions no upstream tools.",
                env.name
            );
            return Ok(structured(&out, text));
        }
        let (listed, unavailable) = self.registry.bridge.catalogue(policy).await;
        let tools: Vec<BridgedTool> = listed
            .iter()
            .map(|l| BridgedTool {
                call: format!("tools.{}.{}", l.info.server, l.info.tool),
                summary: l.info.description.lines().next().unwrap_or_default().chars().take(160).collect(),
                callable: l.callable,
            })
            .collect();
        let mut text = format!(
            "In environment {}, Python code run by run_python may call these tools (at most {} calls and {} s of \
             calls per run):\n",
            env.name,
            policy.calls,
            policy.time.as_secs()
        );
        for t in &tools {
            let mark = if t.callable { "" } else { " [not allowed: writes, not opted in]" };
            text.push_str(&format!("  {}(...){mark}: {}\n", t.call, t.summary));
        }
        for (server, why) in &unavailable {
            text.push_str(&format!("  {server}: unavailable ({why})\n"));
        }
        if let Some(example) = tools.iter().find(|t| t.callable) {
            text.push_str(&format!(
                "Example (one run_python call):\n  import tools\n  print(tools.describe(\"{}\"))\n  \
                 result = {}(...)   # Python data; raises tools.ToolError on failure\n",
                example.call.trim_start_matches("tools."),
                example.call
            ));
        }
        let out = BridgedList {
            environment: env.name.clone(),
            tools,
            unavailable,
            calls_per_run: policy.calls,
            call_time_per_run_s: policy.time.as_secs(),
        };
        Ok(structured(&out, text))
    }
}
