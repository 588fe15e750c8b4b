//! What a keeper may run for a stage: the configuration file's `COMMAND` and `USER` of
//! that stage, read by the launcher ([`crate::launcher`]) from the file itself at each
//! worker's start (the overlay may set neither, so the file is the whole truth).

use std::path::Path;

use super::exec_account;
use super::serve::Mandate;
use crate::config::Config;
use crate::config::graph::STAGE_PREFIX;

/// What a keeper for `stage` may run, from the configuration file at `path`: its
/// `COMMAND` as the account [`exec_account`] gives for its `USER`.
pub fn mandate(path: &Path, stage: &str) -> Result<Mandate, String> {
    let config = Config::load(Some(path)).map_err(|errors| {
        format!(
            "{} does not parse: {}",
            path.display(),
            crate::config::raw::join_errors(&errors)
        )
    })?;
    let name = format!("{STAGE_PREFIX}{stage}");
    let section = config
        .stage_sections
        .iter()
        .find(|s| s.name == name)
        .ok_or_else(|| format!("{} has no [{name}] section", path.display()))?;
    let argv: Vec<String> = section
        .get("COMMAND")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect();
    if argv.is_empty() {
        return Err(format!("[{name}] of {} sets no COMMAND", path.display()));
    }
    let account = exec_account(section.get("USER"), super::Reserved::of(&config.pepsi))
        .map_err(|e| format!("[{name}] {e}"))?;
    Ok(Mandate::Fixed {
        argv,
        account: Some(account),
    })
}
