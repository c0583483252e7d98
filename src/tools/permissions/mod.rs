//! Which tool calls run: rules `allow` / `ask` / `deny` on tools and their arguments, first
//! match wins, then the mode's preset.
//!
//! A rule names a tool (`read`, `*` for all) and optionally what it acts on, in parentheses:
//! for `bash` a command (`bash(cargo test)`, exactly) or a command prefix (`bash(git:*)`); for
//! the file tools (`read`, `write`, `edit`, `ls`, `glob`, `grep`) a glob over the absolute path
//! (`write(/workspace/**)`). Rules guard what a model asks for; they are not the sandbox's
//! boundary (a shell can write where `write` may not): the microVM, its mounts and its network
//! policy are.

mod approval;
mod command;

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use globset::{GlobBuilder, GlobMatcher};
use serde::{Deserialize, Serialize};

pub(crate) use approval::ApprovalGate;
pub use approval::{Approval, ApprovalRequest, Approver, AuditEvent, Decision};
use command::CommandLine;

use super::spec::TOOL_NAMES;

/// Presets for what runs without a rule of the caller's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// `read`, `ls`, `glob`, `grep`; everything else is denied.
    ReadOnly,
    /// Also `bash` and `process`, and `write`/`edit` under the workspace and `/tmp`.
    #[default]
    WorkspaceWrite,
    /// Everything.
    FullAccess,
}

/// What a rule does with the calls it matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Run it.
    Allow,
    /// Ask the [`Approver`]; run it only if approved.
    Ask,
    /// Refuse it.
    Deny,
}

/// One rule: an action and a pattern, written in JSON as `{"ask": "bash(curl:*)"}`.
///
/// ```
/// use krunbox::tools::Rule;
/// let rule: Rule = serde_json::from_str(r#"{"deny": "bash(git push:*)"}"#).unwrap();
/// assert_eq!(rule.to_string(), "deny bash(git push:*)");
/// assert!(serde_json::from_str::<Rule>(r#"{"deny": "bsh"}"#).is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    /// Run the calls it matches.
    Allow(Pattern),
    /// Ask about the calls it matches.
    Ask(Pattern),
    /// Refuse the calls it matches.
    Deny(Pattern),
}

/// Which calls a rule matches: `tool`, `tool(specifier)` or `*`.
#[derive(Clone, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Pattern {
    text: String,
    /// The tool's index in [`TOOL_NAMES`]; `None` for `*`.
    tool: Option<usize>,
    target: Target,
}

#[derive(Clone)]
enum Target {
    Any,
    Command {
        words: Vec<String>,
        prefix: bool,
    },
    /// A glob over the absolute path; one without `/` over the file name.
    Path {
        glob: GlobMatcher,
        name_only: bool,
    },
}

/// The caller's rules and mode: what [`Toolbox`](super::Toolbox) checks before each call.
///
/// ```
/// use krunbox::tools::{Mode, Permissions, Rule};
/// let permissions: Permissions = serde_json::from_value(serde_json::json!({
///     "mode": "workspace-write",
///     "rules": [{"deny": "bash(git push:*)"}, {"ask": "bash(curl:*)"}, {"allow": "bash(cargo:*)"}]
/// })).unwrap();
/// assert_eq!(permissions.mode, Mode::WorkspaceWrite);
/// assert_eq!(permissions.rules.len(), 3);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Permissions {
    /// The preset applied after the rules.
    #[serde(default)]
    pub mode: Mode,
    /// Checked in order before the mode's preset; the first that matches decides.
    #[serde(default)]
    pub rules: Vec<Rule>,
}

/// What a call is about, for matching: a command line, a path, or nothing (`process`).
pub(crate) enum Subject<'a> {
    Command(&'a str),
    Path(&'a Path),
    Nothing,
}

/// What the rules decided, and which rule (or mode) decided it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Verdict {
    pub(crate) action: Action,
    pub(crate) by: String,
}

impl Permissions {
    /// `mode` and no rules.
    pub fn mode(mode: Mode) -> Permissions {
        Permissions {
            mode,
            rules: Vec::new(),
        }
    }

    /// Adds a rule after the others.
    pub fn rule(mut self, rule: Rule) -> Permissions {
        self.rules.push(rule);
        self
    }

    /// Whether no call of `tool` can ever run: the first rule that names it (or `*`) is a bare
    /// `deny` of it. Such a tool is not offered to the model.
    pub(crate) fn refuses_outright(&self, tool: &str) -> bool {
        let first = self.rules.iter().find(|rule| {
            let (_, pattern) = rule.parts();
            pattern.tool.is_none_or(|t| TOOL_NAMES[t] == tool)
        });
        matches!(first, Some(Rule::Deny(p)) if matches!(p.target, Target::Any))
    }

    /// Whether a path rule (not a bare rule, not the mode) denies `tool` on `path`: a search
    /// does not show what such a rule keeps from `read` or from the search itself.
    pub(crate) fn rule_denies(&self, tool: &str, path: &Path) -> bool {
        let subject = Subject::Path(path);
        let first = self.rules.iter().find_map(|rule| {
            let (action, pattern) = rule.parts();
            let by_path = matches!(pattern.target, Target::Path { .. });
            (by_path && pattern.matches(tool, &subject, action)).then_some(action)
        });
        first == Some(Action::Deny)
    }

    /// Whether a tool is offered at all (see [`Toolbox::definitions`](super::Toolbox)): not
    /// when the first rule naming it (or `*`) is a bare `deny`.
    pub fn offers(&self, tool: &str) -> bool {
        !self.refuses_outright(tool)
    }

    pub(crate) fn decide(&self, tool: &str, subject: &Subject<'_>, workspace: &Path) -> Verdict {
        for rule in &self.rules {
            let (action, pattern) = rule.parts();
            if pattern.matches(tool, subject, action) {
                return Verdict {
                    action,
                    by: rule.to_string(),
                };
            }
        }
        let by = format!("mode {}", self.mode);
        let action = match (self.mode, tool) {
            (Mode::FullAccess, _) => Action::Allow,
            (_, "read" | "ls" | "glob" | "grep") => Action::Allow,
            (Mode::ReadOnly, _) => Action::Deny,
            (Mode::WorkspaceWrite, "bash" | "process") => Action::Allow,
            (Mode::WorkspaceWrite, _) => match subject {
                Subject::Path(path) if path.starts_with(workspace) || path.starts_with("/tmp") => {
                    Action::Allow
                }
                _ => Action::Deny,
            },
        };
        Verdict { action, by }
    }
}

impl Rule {
    fn parts(&self) -> (Action, &Pattern) {
        match self {
            Rule::Allow(p) => (Action::Allow, p),
            Rule::Ask(p) => (Action::Ask, p),
            Rule::Deny(p) => (Action::Deny, p),
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (action, pattern) = self.parts();
        write!(f, "{action} {pattern}")
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Action::Allow => "allow",
            Action::Ask => "ask",
            Action::Deny => "deny",
        })
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::ReadOnly => "read-only",
            Mode::WorkspaceWrite => "workspace-write",
            Mode::FullAccess => "full-access",
        })
    }
}

impl FromStr for Mode {
    type Err = String;

    fn from_str(text: &str) -> Result<Mode, String> {
        match text {
            "read-only" => Ok(Mode::ReadOnly),
            "workspace-write" => Ok(Mode::WorkspaceWrite),
            "full-access" => Ok(Mode::FullAccess),
            other => Err(format!(
                "unknown mode {other:?}: read-only, workspace-write or full-access"
            )),
        }
    }
}

impl FromStr for Rule {
    type Err = String;

    /// `allow read`, `ask bash(curl:*)`, `deny write(/etc/**)`: the form flags take.
    fn from_str(text: &str) -> Result<Rule, String> {
        let (action, pattern) = text
            .trim()
            .split_once(char::is_whitespace)
            .ok_or_else(|| format!("rule {text:?}: write `allow|ask|deny PATTERN`"))?;
        let pattern: Pattern = pattern.trim().parse()?;
        match action {
            "allow" => Ok(Rule::Allow(pattern)),
            "ask" => Ok(Rule::Ask(pattern)),
            "deny" => Ok(Rule::Deny(pattern)),
            other => Err(format!(
                "rule {text:?}: {other:?} is not allow, ask or deny"
            )),
        }
    }
}

impl Pattern {
    fn matches(&self, tool: &str, subject: &Subject<'_>, action: Action) -> bool {
        if self.tool.is_some_and(|t| TOOL_NAMES[t] != tool) {
            return false;
        }
        match (&self.target, subject) {
            (Target::Any, _) => true,
            (Target::Command { words, prefix }, Subject::Command(text)) => {
                let line = CommandLine::parse(text);
                match action {
                    Action::Allow => line.all_start_with(words, !prefix),
                    // Refusing or asking errs on the side of matching.
                    Action::Ask | Action::Deny => line.mentions(words),
                }
            }
            (Target::Path { glob, name_only }, Subject::Path(path)) => match name_only {
                true => path.file_name().is_some_and(|name| glob.is_match(name)),
                false => glob.is_match(path),
            },
            _ => false,
        }
    }
}

impl FromStr for Pattern {
    type Err = String;

    fn from_str(text: &str) -> Result<Pattern, String> {
        let bad = |why: &str| format!("pattern {text:?}: {why}");
        let (name, specifier) = match text.split_once('(') {
            Some((name, rest)) => {
                let inner = rest
                    .strip_suffix(')')
                    .ok_or_else(|| bad("a specifier ends with `)`"))?;
                (name.trim(), Some(inner.trim()))
            }
            None => (text.trim(), None),
        };
        let tool = match name {
            "*" => None,
            name => Some(TOOL_NAMES.iter().position(|t| *t == name).ok_or_else(|| {
                bad(&format!(
                    "no tool {name:?}; the tools are {}",
                    TOOL_NAMES.join(", ")
                ))
            })?),
        };
        let target = match (tool.map(|t| TOOL_NAMES[t]), specifier) {
            (_, None) | (_, Some("*")) => Target::Any,
            (None, Some(_)) => return Err(bad("`*` takes no specifier")),
            (Some("process"), Some(_)) => return Err(bad("`process` takes no specifier")),
            (Some("bash"), Some(command)) => {
                let (command, prefix) = match command.strip_suffix(":*") {
                    Some(prefix) => (prefix, true),
                    None => (command, false),
                };
                let words = shlex::split(command).ok_or_else(|| bad("unbalanced quotes"))?;
                if words.is_empty() {
                    return Err(bad("an empty command"));
                }
                Target::Command { words, prefix }
            }
            (Some(_), Some(glob)) => {
                let name_only = !glob.contains('/');
                if !name_only && !glob.starts_with('/') {
                    return Err(bad(
                        "a path glob is absolute (`/workspace/**`) or a file name (`*.lock`)",
                    ));
                }
                let glob = GlobBuilder::new(glob)
                    .literal_separator(true)
                    .build()
                    .map_err(|e| bad(&e.to_string()))?;
                Target::Path {
                    glob: glob.compile_matcher(),
                    name_only,
                }
            }
        };
        Ok(Pattern {
            text: text.trim().to_owned(),
            tool,
            target,
        })
    }
}

impl TryFrom<String> for Pattern {
    type Error = String;
    fn try_from(text: String) -> Result<Pattern, String> {
        text.parse()
    }
}

impl From<Pattern> for String {
    fn from(pattern: Pattern) -> String {
        pattern.text
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl fmt::Debug for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Pattern({:?})", self.text)
    }
}

impl PartialEq for Pattern {
    fn eq(&self, other: &Pattern) -> bool {
        self.text == other.text
    }
}

impl Eq for Pattern {}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(rules: &[&str], mode: Mode) -> Permissions {
        Permissions {
            mode,
            rules: rules.iter().map(|r| r.parse().unwrap()).collect(),
        }
    }

    fn decide(p: &Permissions, tool: &str, subject: Subject<'_>) -> (Action, String) {
        let v = p.decide(tool, &subject, Path::new("/workspace"));
        (v.action, v.by)
    }

    #[test]
    fn the_first_matching_rule_wins_then_the_mode() {
        let p = rules(
            &[
                "deny bash(git push:*)",
                "ask bash(curl:*)",
                "allow bash(git:*)",
            ],
            Mode::ReadOnly,
        );
        let bash = |c| decide(&p, "bash", Subject::Command(c));
        assert_eq!(bash("git push origin").0, Action::Deny);
        assert_eq!(bash("git status").0, Action::Allow);
        assert_eq!(bash("git status; curl x").0, Action::Ask);
        assert_eq!(bash("ls").0, Action::Deny);
        assert_eq!(bash("ls").1, "mode read-only");
        assert_eq!(
            decide(&p, "read", Subject::Path(Path::new("/etc/passwd"))).0,
            Action::Allow
        );
    }

    #[test]
    fn modes_preset_what_rules_leave_open() {
        let ws = rules(&[], Mode::WorkspaceWrite);
        let write = |p: &Permissions, path| decide(p, "write", Subject::Path(Path::new(path))).0;
        assert_eq!(write(&ws, "/workspace/a/b.txt"), Action::Allow);
        assert_eq!(write(&ws, "/tmp/x"), Action::Allow);
        assert_eq!(write(&ws, "/etc/passwd"), Action::Deny);
        assert_eq!(write(&ws, "/workspace-other/x"), Action::Deny);
        assert_eq!(
            decide(&ws, "bash", Subject::Command("make")).0,
            Action::Allow
        );
        let full = rules(&[], Mode::FullAccess);
        assert_eq!(write(&full, "/etc/passwd"), Action::Allow);
        let ro = rules(&[], Mode::ReadOnly);
        assert_eq!(decide(&ro, "process", Subject::Nothing).0, Action::Deny);
    }

    #[test]
    fn path_rules_are_globs_over_absolute_paths() {
        let p = rules(
            &["deny edit(/workspace/.git/**)", "ask write(*.lock)"],
            Mode::FullAccess,
        );
        let edit = decide(
            &p,
            "edit",
            Subject::Path(Path::new("/workspace/.git/config")),
        );
        assert_eq!(edit, (Action::Deny, "deny edit(/workspace/.git/**)".into()));
        assert_eq!(
            decide(&p, "write", Subject::Path(Path::new("/w/Cargo.lock"))).0,
            Action::Ask
        );
        assert_eq!(
            decide(&p, "write", Subject::Path(Path::new("/w/Cargo.toml"))).0,
            Action::Allow
        );
        assert_eq!(
            decide(&p, "edit", Subject::Path(Path::new("/workspace/.gitx"))).0,
            Action::Allow
        );
    }

    #[test]
    fn only_a_tool_no_call_of_which_can_run_is_withheld() {
        let p = rules(
            &[
                "allow bash(git:*)",
                "deny bash",
                "deny edit",
                "deny read(/secret/**)",
            ],
            Mode::FullAccess,
        );
        assert!(!p.refuses_outright("bash"));
        assert!(p.refuses_outright("edit"));
        assert!(!p.refuses_outright("read"));
        assert!(rules(&["deny *", "allow read"], Mode::FullAccess).refuses_outright("read"));
        assert!(p.rule_denies("read", Path::new("/secret/key")));
        assert!(!rules(&["deny read"], Mode::FullAccess).rule_denies("read", Path::new("/a")));
        assert!(!p.rule_denies("read", Path::new("/public/key")));
    }

    #[test]
    fn malformed_rules_are_refused_with_a_reason() {
        for (text, says) in [
            ("allow bsh", "no tool"),
            ("allow bash(", "ends with"),
            ("allow write(relative/**)", "absolute"),
            ("allow process(x)", "no specifier"),
            ("permit read", "not allow"),
            ("allow bash()", "empty"),
            ("read", "allow|ask|deny"),
        ] {
            let err = text.parse::<Rule>().unwrap_err();
            assert!(err.contains(says), "{text}: {err}");
        }
    }

    #[test]
    fn permissions_round_trip_through_json() {
        let p = rules(&["deny bash(rm -rf:*)", "allow *"], Mode::ReadOnly);
        let json = serde_json::to_value(&p).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"mode": "read-only", "rules": [{"deny": "bash(rm -rf:*)"}, {"allow": "*"}]})
        );
        assert_eq!(serde_json::from_value::<Permissions>(json).unwrap(), p);
    }
}
