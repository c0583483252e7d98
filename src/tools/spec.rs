//! What a model is shown of each tool (name, description, JSON Schema) and what it gets back,
//! in the shapes the model APIs take: MCP, OpenAI function calling, Anthropic tool use.

use serde_json::{json, Map, Value};

use super::call;

/// The tools, in the order they are listed.
pub const TOOL_NAMES: [&str; 8] = [
    "bash", "process", "read", "write", "edit", "ls", "glob", "grep",
];

/// One tool as a model sees it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ToolDefinition {
    /// `bash`, `read`, …
    pub name: &'static str,
    /// What it does and when to use it, for the model.
    pub description: &'static str,
    /// A JSON Schema (draft 2020-12) of its arguments: an object.
    pub input_schema: Value,
}

impl ToolDefinition {
    /// An MCP `Tool` (`tools/list`): `{name, description, inputSchema}`.
    pub fn to_mcp(&self) -> Value {
        json!({
            "name": self.name,
            "description": self.description,
            "inputSchema": self.input_schema,
        })
    }

    /// An OpenAI function tool (Chat Completions `tools`):
    /// `{type: "function", function: {name, description, parameters}}`.
    pub fn to_openai(&self) -> Value {
        json!({
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.input_schema,
            },
        })
    }

    /// An Anthropic tool (Messages API `tools`): `{name, description, input_schema}`.
    pub fn to_anthropic(&self) -> Value {
        json!({
            "name": self.name,
            "description": self.description,
            "input_schema": self.input_schema,
        })
    }
}

/// Every tool's definition, from the argument types the dispatcher parses.
///
/// ```
/// let tools = krunbox::tools::definitions();
/// let read = tools.iter().find(|t| t.name == "read").unwrap();
/// assert_eq!(read.input_schema["required"], serde_json::json!(["path"]));
/// // What OpenAI's Chat Completions API takes as `tools`:
/// let openai: Vec<_> = tools.iter().map(|t| t.to_openai()).collect();
/// assert_eq!(openai[0]["function"]["name"], "bash");
/// ```
pub fn definitions() -> Vec<ToolDefinition> {
    vec![
        define::<call::Bash>("bash", BASH),
        define::<call::Process>("process", PROCESS),
        define::<call::Read>("read", READ),
        define::<call::Write>("write", WRITE),
        define::<call::Edit>("edit", EDIT),
        define::<call::Ls>("ls", LS),
        define::<call::Glob>("glob", GLOB),
        define::<call::Grep>("grep", GREP),
    ]
}

fn define<T: schemars::JsonSchema>(
    name: &'static str,
    description: &'static str,
) -> ToolDefinition {
    let schema = schemars::schema_for!(T);
    let mut object = match schema.to_value() {
        Value::Object(object) => object,
        // schemars makes an object schema for a struct; anything else is a bug here.
        other => unreachable!("schema of {name} is not an object: {other}"),
    };
    // The model needs neither: the name is the tool's, the dialect is the API's default.
    object.remove("$schema");
    object.remove("title");
    // The struct's doc comment: the tool's description says it better, for the model.
    object.remove("description");
    let mut schema = Value::Object(object);
    unwrap_descriptions(&mut schema);
    ToolDefinition {
        name,
        description,
        input_schema: schema,
    }
}

/// Doc comments keep their line breaks in schemars' descriptions: one line each, for models.
fn unwrap_descriptions(schema: &mut Value) {
    match schema {
        Value::Object(object) => {
            for (key, value) in object.iter_mut() {
                match value {
                    Value::String(text) if key == "description" => *text = text.replace('\n', " "),
                    other => unwrap_descriptions(other),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(unwrap_descriptions),
        _ => {}
    }
}

/// What a tool call returns to the model: text, and whether it is an error the model should
/// act on (a failed command, a missing file, a refused permission, bad arguments).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ToolResult {
    /// The text shown to the model. Always bounded; says when and where it was cut.
    pub text: String,
    /// The call failed (the model should read `text` and change course).
    pub is_error: bool,
}

impl ToolResult {
    /// A result, as a binding or a test makes one.
    ///
    /// ```
    /// let result = krunbox::tools::ToolResult::new("exit code 1\n", true);
    /// assert_eq!(result.to_mcp()["isError"], true);
    /// ```
    pub fn new(text: impl Into<String>, is_error: bool) -> ToolResult {
        ToolResult {
            text: text.into(),
            is_error,
        }
    }

    pub(crate) fn ok(text: impl Into<String>) -> ToolResult {
        ToolResult {
            text: text.into(),
            is_error: false,
        }
    }

    pub(crate) fn error(text: impl Into<String>) -> ToolResult {
        ToolResult {
            text: text.into(),
            is_error: true,
        }
    }

    /// An MCP `CallToolResult`: `{content: [{type: "text", text}], isError}`.
    pub fn to_mcp(&self) -> Value {
        json!({
            "content": [{"type": "text", "text": self.text}],
            "isError": self.is_error,
        })
    }

    /// An OpenAI tool message answering the call `call_id`.
    pub fn to_openai(&self, call_id: &str) -> Value {
        json!({"role": "tool", "tool_call_id": call_id, "content": self.text})
    }

    /// An Anthropic `tool_result` content block answering the `tool_use` block `tool_use_id`.
    pub fn to_anthropic(&self, tool_use_id: &str) -> Value {
        let mut block = Map::new();
        block.insert("type".into(), "tool_result".into());
        block.insert("tool_use_id".into(), tool_use_id.into());
        block.insert("content".into(), self.text.clone().into());
        if self.is_error {
            block.insert("is_error".into(), true.into());
        }
        Value::Object(block)
    }
}

const BASH: &str = "Run a shell command in the sandbox (a Linux microVM) with `sh -lc`, in the \
workspace unless `cwd` says otherwise. Returns the exit code and output; long output is cut in \
the middle, with a note. Commands time out after `timeout_secs` (default 120). For servers, \
watchers and long builds set `background: true`: it returns an id at once, and the `process` \
tool polls, feeds and kills it. Prefer the file tools (read, write, edit, ls, glob, grep) to \
cat, sed, echo, find and grep in the shell.";

const PROCESS: &str = "Follow a process started by `bash` with `background: true`: `poll` (its \
status and the output since the last poll), `write` (text to its stdin; `close_stdin` to end \
its input), `kill`, or `list` (every background process).";

const READ: &str = "Read a text file, each line prefixed by its number. Shows up to `limit` \
lines (default 2000) from line `offset` (default 1); a long file or line is cut with a note \
saying how to read on. Binary files are reported, not shown.";

const WRITE: &str = "Create or replace a file with `content`, creating missing directories. \
To change part of an existing file, use `edit`.";

const EDIT: &str = "Replace exact strings in one file. Each of `edits` replaces `old_string` \
(which must occur exactly once, or set `replace_all`) with `new_string`, in order; if any edit \
fails, the file is left unchanged. Read the file first: `old_string` must match it exactly, \
indentation included.";

const LS: &str = "List a directory: directories end with `/`, files show their size. Honours \
.gitignore; hidden entries only with `hidden`. `depth` lists deeper levels.";

const GLOB: &str = "Find files by name pattern under a directory, honouring .gitignore: `*.py` \
matches at any depth, `src/**/*.rs` matches paths. Returns absolute paths, sorted.";

const GREP: &str = "Search file contents with a regex (ripgrep syntax) under a directory, \
honouring .gitignore and skipping binary files. Returns `path:line:text` lines (context lines \
as `path-line-text`), or only file paths with `output: \"files\"`. Filter files with `glob`.";
