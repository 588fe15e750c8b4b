//! `pepsi-stage-discard`: deletes the row; the message is done. Metadata only, fusable
//! by default. Every recipient of a message it deletes gets its delivery log line
//! (`status=discarded (discarded by STAGE)`) and its row in `pepsi.history`, as
//! Postfix's discard(8) logs one: a pipeline that routes mail here by mistake shows
//! it. With `[pepsi] DELIVERY_LOG = no` the stage logs each message at INFO instead
//! (its id, sender and recipients, the stage); otherwise that line is DEBUG.
//!
//! Listed in `stages::BUILTINS`; the worker runtime calls its `configure` at start
//! and for each effective section and runs the body it returns, and `pepsi-dispatch
//! check` calls `configure`. It owns its section's keys and its decision; it must
//! not write to the database (the runtime writes its outcome) nor know about batches,
//! fusion or the protocol.

use crate::config::{ConfigError, MailLogTarget, StageSection};
use crate::escape::Visible;
use crate::worker::{Configured, Context, Load, Message, Outcome, Stage, StageError};

/// The most recipients a discard's log line names; the others are counted.
const NAMED_RECIPIENTS: usize = 5;

/// The stage.
pub struct Discard;

struct ConfiguredDiscard;

impl Stage for Discard {
    fn name(&self) -> &'static str {
        "discard"
    }

    fn loads(&self) -> Load {
        Load::Metadata
    }

    fn fusion_default(&self) -> bool {
        true
    }

    fn delivers(&self) -> bool {
        false
    }

    fn keys(&self) -> &'static [&'static str] {
        &[]
    }

    fn overridable(&self) -> &'static [&'static str] {
        &[]
    }

    fn ignored(&self) -> &'static [(&'static str, &'static str)] {
        &[("NEXT", "it deletes every message it gets")]
    }

    fn configure(&self, _section: &StageSection) -> Result<Box<dyn Configured>, ConfigError> {
        Ok(Box::new(ConfiguredDiscard))
    }
}

/// The recipients as a discard's log line names them: the first few, escaped, and
/// how many more.
fn named(recipients: &[String]) -> String {
    let mut text = recipients
        .iter()
        .take(NAMED_RECIPIENTS)
        .map(|r| format!("<{}>", Visible(r)))
        .collect::<Vec<_>>()
        .join(", ");
    if recipients.len() > NAMED_RECIPIENTS {
        text.push_str(&format!(
            " and {} more",
            recipients.len() - NAMED_RECIPIENTS
        ));
    }
    text
}

impl Configured for ConfiguredDiscard {
    fn run(&self, message: &mut Message, cx: &mut Context<'_>) -> Result<Outcome, StageError> {
        // With a delivery log, its line for each recipient (status=discarded) says it;
        // without one, this line does.
        let level = if cx.pepsi.delivery_log == MailLogTarget::Off {
            log::Level::Info
        } else {
            log::Level::Debug
        };
        log::log!(
            level,
            "{}: message {} from <{}> to {}: discarded (stage {} deletes every message it gets)",
            cx.section.name,
            message.id,
            Visible(message.mail_from()),
            named(message.rcpt_to()),
            cx.section.name
        );
        Ok(Outcome::Finish)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_discard_names_a_few_recipients_escaped_and_counts_the_rest() {
        let few: Vec<String> = vec!["a@x.example".into(), "b\r\n@x.example".into()];
        assert_eq!(named(&few), "<a@x.example>, <b\\r\\n@x.example>");
        let bidi: Vec<String> = vec!["\u{202e}moc.x@a".into()];
        assert_eq!(named(&bidi), "<\\u{202e}moc.x@a>");
        let ten_thousand: Vec<String> = (0..10_000).map(|i| format!("r{i}@x.example")).collect();
        assert!(named(&ten_thousand).ends_with(" and 9995 more"));
        assert!(named(&ten_thousand).len() < 200);
        let many: Vec<String> = (0..8).map(|i| format!("r{i}@x.example")).collect();
        assert_eq!(
            named(&many),
            "<r0@x.example>, <r1@x.example>, <r2@x.example>, <r3@x.example>, <r4@x.example> and 3 more"
        );
    }
}
