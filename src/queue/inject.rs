//! `pepsi-queue inject`: reads a message from a file or standard input, checks the
//! envelope and the header block ([`super::message`]) before connecting, then queues it
//! with one call of `pepsi.workqueue_inject` (one round trip, one NOTIFY) and prints
//! its id. Anything refused leaves nothing behind: the only write is that one call.

use std::io::Read;

use serde_json::Value;

use super::args::{Inject, Input};
use super::{Session, db_failure, emit};
use crate::db::sql;
use crate::exit::{EX_DATAERR, EX_NOINPUT, EX_TEMPFAIL, Failure};
use crate::intake::{self, Message};

/// A message ready to be queued.
#[derive(Debug)]
pub struct Prepared {
    stage: String,
    mail_from: String,
    rcpt_to: Vec<String>,
    message: Message,
    auth_user: Option<String>,
    client_ip: Option<String>,
    state: serde_json::Map<String, Value>,
}

/// Bad data: exit 65, saying that nothing was injected.
fn refused(why: String) -> Failure {
    Failure::new(EX_DATAERR, format!("{why}; nothing was injected"))
}

/// Checks the envelope and reads and checks the message. Touches no database.
pub fn prepare(what: &Inject) -> Result<Prepared, Failure> {
    let mail_from = intake::envelope_address(&what.from, true)
        .map_err(|why| refused(format!("sender {:?}: {why}", what.from)))?;
    let rcpt_to = what
        .to
        .iter()
        .map(|r| {
            intake::envelope_address(r, false)
                .map_err(|why| refused(format!("recipient {r:?}: {why}")))
        })
        .collect::<Result<Vec<String>, Failure>>()?;
    let (name, bytes) = match &what.input {
        Input::Stdin => {
            let mut bytes = Vec::new();
            std::io::stdin().read_to_end(&mut bytes).map_err(|e| {
                Failure::new(
                    EX_NOINPUT,
                    format!("cannot read the message from standard input: {e}"),
                )
            })?;
            ("standard input".to_string(), bytes)
        }
        Input::File(path) => {
            let bytes = std::fs::read(path).map_err(|e| {
                Failure::new(
                    EX_NOINPUT,
                    format!("cannot read the message file {}: {e}", path.display()),
                )
            })?;
            (path.display().to_string(), bytes)
        }
    };
    let message = intake::read(&bytes).map_err(|why| refused(format!("{name}: {why}")))?;
    let mut state = what.state.clone().unwrap_or_default();
    if what.local {
        state.insert("local_origin".into(), Value::Bool(true));
    }
    Ok(Prepared {
        stage: what.stage.clone(),
        mail_from,
        rcpt_to,
        message,
        auth_user: what.auth_user.clone(),
        client_ip: what.client_ip.map(|ip| ip.to_string()),
        state,
    })
}

/// Queues a prepared message at a stage that has a section, and prints its id.
pub fn run(session: &mut Session, p: Prepared) -> Result<(), Failure> {
    // A message queued at a stage without a section would never be claimed.
    if !session.configured_stages()?.contains(&p.stage) {
        return Err(refused(format!(
            "--stage {:?}: no [stage-{}] section in the configuration or the overlay",
            p.stage, p.stage
        )));
    }
    let state = Value::Object(p.state).to_string();
    let id: i64 = session
        .client
        .query_one(
            sql::INJECT,
            &[
                &p.stage,
                &p.mail_from,
                &p.rcpt_to,
                &p.message.headers,
                &p.message.body,
                &p.auth_user,
                &p.client_ip,
                &p.message.header_from,
                &p.message.subject,
                &state,
            ],
        )
        .map_err(|e| db_failure("injecting the message", &e))?
        .get(0);
    log::debug!(
        "injected message {id} at stage {} for {} recipients",
        p.stage,
        p.rcpt_to.len()
    );
    // The message is queued: from here on a failure must not make the handing-over
    // MTA retry (a duplicate) or bounce it.
    if let Err(e) = emit(format!("{id}\n").as_bytes()) {
        log::warn!("message {id} was queued, but its id could not be printed: {e}");
    }
    Ok(())
}

/// A failure of `inject` after the message itself was read and accepted: the
/// database, the configuration, the schema, the stage or a privilege. None of it is
/// the message's fault, so it exits 75 (`EX_TEMPFAIL`): an MTA handing the message
/// over (Postfix `pipe(8)` defers only on 75 and 71, and bounces every other code)
/// keeps it and tries again, instead of bouncing it while an operator fixes the
/// cause. The reason is kept as it was, with the code it would otherwise have had.
pub fn for_the_sender(failure: Failure) -> Failure {
    if failure.code == EX_TEMPFAIL {
        return failure;
    }
    let code = failure.code;
    Failure::new(
        EX_TEMPFAIL,
        format!(
            "{}; not the message's fault, so exit 75 (try again later) rather than {code}",
            failure.message
        ),
    )
}
