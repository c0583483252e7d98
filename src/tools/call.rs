//! The tools' arguments: one Rust type each, which both parses a model's JSON arguments and
//! gives the JSON Schema the model is shown (doc comments become descriptions).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Arguments of `bash`: run a shell command (`sh -lc`), in the foreground or the background.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Bash {
    /// The command line, run by `sh -lc` (pipes, redirections and globs work).
    pub command: String,
    /// Seconds before a foreground command is killed (default 120, at most 600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u32>,
    /// Start it in the background and return its id at once; follow it with the `process`
    /// tool. For servers, watchers and long builds.
    #[serde(default)]
    pub background: bool,
    /// Working directory (default: the workspace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// What the `process` tool does with a background process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ProcessAction {
    /// Its status and the output it printed since the last poll.
    Poll,
    /// Write `input` to its stdin (and close stdin with `close_stdin`).
    Write,
    /// Kill it (SIGKILL to its process group).
    Kill,
    /// Every background process with its status.
    List,
}

/// Arguments of `process`: follow a process started by `bash` with `background: true`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Process {
    /// What to do.
    pub action: ProcessAction,
    /// The id `bash` returned (not needed for `list`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<u32>,
    /// Text written to stdin (`write`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<String>,
    /// Close stdin after writing (`write`), so a reader sees end of input.
    #[serde(default)]
    pub close_stdin: bool,
}

/// Arguments of `read`: a text file with line numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Read {
    /// The file (absolute, or relative to the workspace).
    pub path: String,
    /// The first line to show, 1-based (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub offset: Option<u64>,
    /// How many lines to show (default 2000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub limit: Option<u64>,
}

/// Arguments of `write`: create or replace a file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Write {
    /// The file (absolute, or relative to the workspace); missing directories are created.
    pub path: String,
    /// The whole new content.
    pub content: String,
}

/// One replacement of an `edit`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Replacement {
    /// The exact text to replace, whitespace included; must occur exactly once unless
    /// `replace_all` (add surrounding lines to make it unique).
    pub old_string: String,
    /// The text to put in its place.
    pub new_string: String,
    /// Replace every occurrence instead of exactly one.
    #[serde(default)]
    pub replace_all: bool,
}

/// Arguments of `edit`: exact string replacements in one file, applied all or none.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Edit {
    /// The file (absolute, or relative to the workspace).
    pub path: String,
    /// Applied in order, each to the result of the previous; if any fails, none is applied.
    #[schemars(length(min = 1))]
    pub edits: Vec<Replacement>,
}

/// Arguments of `ls`: a directory's entries, honouring `.gitignore`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Ls {
    /// The directory (default: the workspace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Levels to list (default 1: the directory's own entries; at most 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 5))]
    pub depth: Option<u32>,
    /// Also list hidden entries (`.name`).
    #[serde(default)]
    pub hidden: bool,
}

/// Arguments of `glob`: files whose path matches a pattern, honouring `.gitignore`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Glob {
    /// A glob: without `/` it matches file names at any depth (`*.py`), with `/` the path
    /// from `path` (`src/**/*.rs`); `*` never crosses a `/`, `**` does.
    pub pattern: String,
    /// The directory searched (default: the workspace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

/// How `grep` reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum GrepOutput {
    /// Matching lines as `path:line:text` (the default).
    #[default]
    Content,
    /// Only the paths of matching files.
    Files,
}

/// Arguments of `grep`: lines matching a regex, in files under a directory, honouring
/// `.gitignore`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Grep {
    /// A regex (ripgrep's syntax: `fn \w+`, `(?i)todo`).
    pub pattern: String,
    /// The directory searched (default: the workspace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Only files matching this glob (`*.rs`, `src/**/*.ts`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub glob: Option<String>,
    /// Ignore case.
    #[serde(default)]
    pub case_insensitive: bool,
    /// Lines of context around each match (at most 20).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 20))]
    pub context: Option<u32>,
    /// `content` (default) or `files`.
    #[serde(default)]
    pub output: GrepOutput,
}

/// One tool call with its parsed arguments: what [`Toolbox::run`](super::Toolbox::run) takes.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ToolCall {
    /// `bash`.
    Bash(Bash),
    /// `process`.
    Process(Process),
    /// `read`.
    Read(Read),
    /// `write`.
    Write(Write),
    /// `edit`.
    Edit(Edit),
    /// `ls`.
    Ls(Ls),
    /// `glob`.
    Glob(Glob),
    /// `grep`.
    Grep(Grep),
}

/// Arguments a model sent that do not fit the tool: the message says what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ArgumentError {
    /// E.g. `invalid arguments for read: missing field `path``.
    pub message: String,
}

impl ToolCall {
    /// Parses a model's call: a tool name and its JSON arguments.
    ///
    /// ```
    /// use krunbox::tools::ToolCall;
    /// let call = ToolCall::parse("read", serde_json::json!({"path": "src/main.rs"})).unwrap();
    /// assert_eq!(call.name(), "read");
    /// let err = ToolCall::parse("read", serde_json::json!({"file": "x"})).unwrap_err();
    /// assert!(err.message.contains("unknown field `file`"), "{err}");
    /// ```
    pub fn parse(name: &str, arguments: serde_json::Value) -> Result<ToolCall, ArgumentError> {
        // Models often send `{}` as null or omit it for tools without required arguments.
        let arguments = match arguments {
            serde_json::Value::Null => serde_json::Value::Object(Default::default()),
            other => other,
        };
        fn args<T: serde::de::DeserializeOwned>(
            name: &str,
            value: serde_json::Value,
        ) -> Result<T, ArgumentError> {
            serde_json::from_value(value).map_err(|err| ArgumentError {
                message: format!("invalid arguments for {name}: {err}"),
            })
        }
        Ok(match name {
            "bash" => ToolCall::Bash(args(name, arguments)?),
            "process" => ToolCall::Process(args(name, arguments)?),
            "read" => ToolCall::Read(args(name, arguments)?),
            "write" => ToolCall::Write(args(name, arguments)?),
            "edit" => ToolCall::Edit(args(name, arguments)?),
            "ls" => ToolCall::Ls(args(name, arguments)?),
            "glob" => ToolCall::Glob(args(name, arguments)?),
            "grep" => ToolCall::Grep(args(name, arguments)?),
            other => {
                return Err(ArgumentError {
                    message: format!(
                        "there is no tool named {other:?}; the tools are {}",
                        super::spec::TOOL_NAMES.join(", ")
                    ),
                })
            }
        })
    }

    /// The tool's name.
    pub fn name(&self) -> &'static str {
        match self {
            ToolCall::Bash(_) => "bash",
            ToolCall::Process(_) => "process",
            ToolCall::Read(_) => "read",
            ToolCall::Write(_) => "write",
            ToolCall::Edit(_) => "edit",
            ToolCall::Ls(_) => "ls",
            ToolCall::Glob(_) => "glob",
            ToolCall::Grep(_) => "grep",
        }
    }

    /// The arguments as JSON (for audit events and approval prompts).
    pub fn arguments(&self) -> serde_json::Value {
        let value = match self {
            ToolCall::Bash(a) => serde_json::to_value(a),
            ToolCall::Process(a) => serde_json::to_value(a),
            ToolCall::Read(a) => serde_json::to_value(a),
            ToolCall::Write(a) => serde_json::to_value(a),
            ToolCall::Edit(a) => serde_json::to_value(a),
            ToolCall::Ls(a) => serde_json::to_value(a),
            ToolCall::Glob(a) => serde_json::to_value(a),
            ToolCall::Grep(a) => serde_json::to_value(a),
        };
        value.unwrap_or(serde_json::Value::Null)
    }
}
