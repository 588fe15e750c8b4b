//! A loaded message: the row's metadata and the claim token it was loaded under,
//! optionally its header block and body, the per-address settings rows that came with
//! it ([`SettingRow`]), and whether a stage rewrote it.
//!
//! Setters of the envelope and extracted metadata mark the message rewritten, which
//! fusion must know (§12.6) and the write must carry; `state` is free to change. The
//! body is read-only: no write carries it. The header block can only grow at its top
//! ([`Message::prepend_headers`], a signature's way in, §18): the write carries the
//! added fields, never the block.
//!
//! Built by `batch.rs` from a loaded row; read and changed by the stages, `chain.rs`,
//! `settings.rs`, `errors.rs` and `plan.rs`. A leaf: it uses no other file of the
//! worker and must not touch the database.

use std::time::{Duration, SystemTime};

use serde_json::{Map, Value};

/// One row of `pepsi.settings`, as loaded with a message (what it means is
/// `settings.rs`'s).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SettingRow {
    /// The address, lower-case.
    pub address: String,
    /// The stage name.
    pub stage: String,
    /// The option.
    pub key: String,
    /// Its value for this address.
    pub value: String,
}

/// One row being processed.
///
/// A stage reads the header block and the body but cannot replace them: no write
/// carries them, so a rewrite would be silently lost. It may put header fields before
/// the block ([`Message::prepend_headers`]).
///
/// ```
/// # use pepsi::worker::Message;
/// let m = Message::new(1, "s".into(), String::new(), vec!["r@x".into()], None, None,
///                      Default::default(), String::new());
/// assert_eq!((m.headers(), m.body()), (None, None));
/// ```
///
/// ```compile_fail,E0616
/// # use pepsi::worker::Message;
/// let mut m = Message::new(1, "s".into(), String::new(), vec!["r@x".into()], None, None,
///                          Default::default(), String::new());
/// m.headers = Some(b"X-Rewritten: yes\r\n".to_vec());
/// ```
///
/// ```compile_fail,E0616
/// # use pepsi::worker::Message;
/// let mut m = Message::new(1, "s".into(), String::new(), vec!["r@x".into()], None, None,
///                          Default::default(), String::new());
/// m.body = Some(b"rewritten".to_vec());
/// ```
#[derive(Clone, Debug)]
pub struct Message {
    /// `workqueue_id`.
    pub id: i64,
    /// The stage the row was claimed at (every write is guarded by it).
    pub claimed_stage: String,
    /// The claim token the dispatcher stamped on the row when it claimed it (§6
    /// "Claim tokens"), read with the row: every write is guarded by it too, so a
    /// write left over from an earlier claim never lands on a later one.
    pub claim: i64,
    mail_from: String,
    rcpt_to: Vec<String>,
    /// The authenticated submitter.
    pub auth_user: Option<String>,
    /// The SMTP peer, as text.
    pub client_ip: Option<String>,
    header_from: Option<String>,
    subject: Option<String>,
    /// The per-message state object.
    pub state: Map<String, Value>,
    /// The fairness key.
    pub sender_key: String,
    /// How long the message has lived, from `arrived` or `state.dsn_created`, when it
    /// was loaded.
    pub lifetime_age: Duration,
    /// When the message arrived; `None` for a time the system cannot hold.
    pub arrived: Option<SystemTime>,
    /// When it came to the stage it was claimed at (its trail's last pass, else its
    /// arrival), for the delivery log's delays.
    pub entered: Option<SystemTime>,
    /// Its header block's Message-ID (computed by the database), if it has one.
    pub message_id: Option<String>,
    headers: Option<Vec<u8>>,
    body: Option<Vec<u8>>,
    /// Overrides from `pepsi.settings` for the correspondents, all stages.
    pub settings: Vec<SettingRow>,
    rewritten: bool,
    /// The header fields stages put before the stored header block, newest first.
    prepended: Vec<u8>,
}

impl Message {
    /// Builds a loaded message.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: i64,
        stage: String,
        mail_from: String,
        rcpt_to: Vec<String>,
        header_from: Option<String>,
        subject: Option<String>,
        state: Map<String, Value>,
        sender_key: String,
    ) -> Message {
        Message {
            id,
            claimed_stage: stage,
            claim: 0,
            mail_from,
            rcpt_to,
            auth_user: None,
            client_ip: None,
            header_from,
            subject,
            state,
            sender_key,
            lifetime_age: Duration::ZERO,
            arrived: None,
            entered: None,
            message_id: None,
            headers: None,
            body: None,
            settings: Vec::new(),
            rewritten: false,
            prepended: Vec::new(),
        }
    }

    /// The envelope sender; empty is the null sender.
    pub fn mail_from(&self) -> &str {
        &self.mail_from
    }

    /// The envelope recipients.
    pub fn rcpt_to(&self) -> &[String] {
        &self.rcpt_to
    }

    /// The extracted `From:`.
    pub fn header_from(&self) -> Option<&str> {
        self.header_from.as_deref()
    }

    /// The extracted `Subject:`.
    pub fn subject(&self) -> Option<&str> {
        self.subject.as_deref()
    }

    /// The header block, for stages that load it (`Load::Full`). Read-only: no write
    /// carries it.
    pub fn headers(&self) -> Option<&[u8]> {
        self.headers.as_deref()
    }

    /// The body, for stages that load it (`Load::Full`). Read-only: no write carries
    /// it.
    pub fn body(&self) -> Option<&[u8]> {
        self.body.as_deref()
    }

    /// Sets the header block and body as loaded with the row (the runtime, and tests
    /// of stages).
    pub(crate) fn set_content(&mut self, headers: Option<Vec<u8>>, body: Option<Vec<u8>>) {
        self.headers = headers;
        self.body = body;
    }

    /// Sets the header block and body loaded after the pass began, for a fused stage
    /// that needs them (§12.6): the fields earlier stages of the pass prepended go
    /// before the stored block, as the write will put them.
    pub(crate) fn set_late_content(&mut self, headers: Option<Vec<u8>>, body: Option<Vec<u8>>) {
        self.headers = headers.map(|stored| {
            let mut block = self.prepended.clone();
            block.extend_from_slice(&stored);
            block
        });
        self.body = body;
    }

    /// Rewrites the envelope sender.
    pub fn set_mail_from(&mut self, value: String) {
        self.mail_from = value;
        self.rewritten = true;
    }

    /// Rewrites the envelope recipients.
    pub fn set_rcpt_to(&mut self, value: Vec<String>) {
        self.rcpt_to = value;
        self.rewritten = true;
    }

    /// Rewrites the extracted `From:`.
    pub fn set_header_from(&mut self, value: Option<String>) {
        self.header_from = value;
        self.rewritten = true;
    }

    /// Rewrites the extracted `Subject:`.
    pub fn set_subject(&mut self, value: Option<String>) {
        self.subject = value;
        self.rewritten = true;
    }

    /// Puts header fields (each ending with a line end) before the header block:
    /// the loaded block when there is one (a fused successor sends what this stage
    /// added), and the stored one when the outcome is written. The message counts as
    /// rewritten (§12.6). The schema refuses, with the whole write, fields that are not
    /// header fields (an empty line among them would end the block early).
    pub fn prepend_headers(&mut self, fields: &[u8]) {
        if let Some(headers) = &mut self.headers {
            headers.splice(0..0, fields.iter().copied());
        }
        self.prepended.splice(0..0, fields.iter().copied());
        self.rewritten = true;
    }

    /// The header fields stages put before the stored header block (empty: none).
    pub fn prepended(&self) -> &[u8] {
        &self.prepended
    }

    /// Did a stage rewrite the envelope or metadata, or add header fields?
    pub fn rewritten(&self) -> bool {
        self.rewritten
    }

    /// The recipients after a split kept this group on the row (not a rewrite: the
    /// database row already carries it).
    pub(crate) fn keep_recipients(&mut self, group: Vec<String>) {
        self.rcpt_to = group;
    }

    /// Is this a locally submitted message (its correspondent is its sender)?
    pub fn local_origin(&self) -> bool {
        self.state.get("local_origin") == Some(&Value::Bool(true))
    }

    /// Is this a mailing-list copy (never bounced)?
    pub fn list_copy(&self) -> bool {
        self.state.get("list_copy") == Some(&Value::Bool(true))
    }

    /// A state value as text (strings bare, other JSON as JSON), for matching.
    pub fn state_text(&self, key: &str) -> Option<String> {
        self.state.get(key).map(|v| match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
    }
}
