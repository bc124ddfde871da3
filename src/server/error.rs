//! One way a tool fails: [`ToolError`] carries the text the model reads, and rmcp turns a tool's
//! `Err` into a result with `isError: true` (`IntoCallToolResult for Result<T, E>`). Failures
//! are logged here, once, inside the `tool` span that `call_tool` opens, so every tool's failures
//! read the same in the log. Execution failures are never JSON-RPC errors (docs/design.md D8).

use std::fmt::Display;

use rmcp::model::{ContentBlock, IntoContents};

/// A failure a caller can cause or fix, as the model will read it.
#[derive(Debug)]
pub(crate) struct ToolError(String);

impl ToolError {
    /// A failure with this text.
    pub(crate) fn new(text: impl Into<String>) -> Self {
        Self(text.into())
    }
}

impl std::fmt::Display for ToolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl IntoContents for ToolError {
    fn into_contents(self) -> Vec<ContentBlock> {
        tracing::info!(error = %self.0, "tool failed");
        vec![ContentBlock::text(self.0)]
    }
}

impl From<String> for ToolError {
    fn from(text: String) -> Self {
        Self(text)
    }
}

impl From<&str> for ToolError {
    fn from(text: &str) -> Self {
        Self(text.to_owned())
    }
}

macro_rules! from_display {
    ($($t:ty),*) => {$(
        impl From<$t> for ToolError {
            fn from(e: $t) -> Self {
                Self(e.to_string())
            }
        }
    )*};
}
from_display!(crate::session::registry::Error, crate::session::Error, crate::deps::Error);

/// `what: why` for any failure: `.context(format!("cannot read {path}"))?`.
pub(crate) trait Context<T> {
    /// Prefixes the failure with what was being done.
    fn context(self, what: impl Display) -> Result<T, ToolError>;
}

impl<T, E: Display> Context<T> for Result<T, E> {
    fn context(self, what: impl Display) -> Result<T, ToolError> {
        self.map_err(|e| ToolError(format!("{what}: {e}")))
    }
}

/// What every tool returns.
pub(crate) type ToolResult = Result<rmcp::model::CallToolResult, ToolError>;
