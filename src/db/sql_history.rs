//! The statements on what became of messages (schema 22): `pepsi-queue trace`'s
//! reads of the queue and of `pepsi.history`. Named constants like [`super::sql`]'s;
//! run by `queue::trace`. They read only and lock nothing.

/// The message (its original id) a row id belongs to, from the queue and the history
/// (an original's rows carry its id as their origin; a part's split row names it). $1
/// the id (int8). Returns the original ids (int8), at most one each.
pub const TRACE_BY_ID: &str = "SELECT DISTINCT x.o FROM ( \
        SELECT coalesce(q.origin, q.workqueue_id) AS o FROM pepsi.workqueue q \
         WHERE q.workqueue_id = $1 \
        UNION ALL \
        SELECT h.origin FROM pepsi.history h WHERE h.origin = $1 \
        UNION ALL \
        SELECT h.origin FROM pepsi.history h \
         WHERE h.workqueue_id = $1 AND h.event = 'split') x \
      ORDER BY 1";

/// The messages (original ids) with this Message-ID, in the queue (read whole: the
/// queue has no index on it) and the history. $1 the Message-ID with its angle
/// brackets (text), $2 the most to return (int8). Returns the original ids (int8).
pub const TRACE_BY_MESSAGE_ID: &str = "SELECT DISTINCT x.o FROM ( \
        SELECT coalesce(q.origin, q.workqueue_id) AS o FROM pepsi.workqueue q \
         WHERE q.message_id = $1 \
        UNION ALL \
        SELECT h.origin FROM pepsi.history h WHERE h.message_id = $1) x \
      ORDER BY 1 LIMIT $2";

/// The messages (original ids) the next hop knows by this queue id. $1 the id (text),
/// $2 the most to return (int8). Returns the original ids (int8).
pub const TRACE_BY_REMOTE_ID: &str = "SELECT DISTINCT h.origin FROM pepsi.history h \
      WHERE h.remote_id = $1 ORDER BY 1 LIMIT $2";

/// A message's rows still in the queue: the original and every part split from it.
/// $1 the original id (int8). Returns (id int8, stage, status text, the retry time and
/// the arrival as epoch seconds float8, sender, recipients text[], Message-ID, trail
/// as JSON text, the last error).
pub const TRACE_ROWS: &str = "SELECT q.workqueue_id, q.stage, q.status::text, \
            extract(epoch FROM q.timeout)::float8, extract(epoch FROM q.arrived)::float8, \
            q.mail_from, q.rcpt_to, q.message_id, q.trail::text, q.state ->> 'last_error' \
       FROM pepsi.workqueue q \
      WHERE q.workqueue_id = $1 \
         OR q.workqueue_id IN (SELECT h.workqueue_id FROM pepsi.history h \
                                WHERE h.origin = $1 AND h.event = 'split') \
      ORDER BY q.workqueue_id";

/// A message's history, oldest first. $1 the original id (int8), $2 the most rows
/// (int8). Returns (when as epoch seconds float8, row id int8, event, stage, sender,
/// recipient, Message-ID, relay, reply, remote id, status, arrival as epoch seconds
/// float8, queued_ms int8, stage_ms int8, detail as JSON text, trail).
pub const TRACE_HISTORY: &str = "SELECT extract(epoch FROM h.at)::float8, h.workqueue_id, \
            h.event, h.stage, h.mail_from, h.recipient, h.message_id, h.relay, h.reply, \
            h.remote_id, h.dsn, extract(epoch FROM h.arrived)::float8, h.queued_ms, \
            h.stage_ms, h.detail::text, h.trail \
       FROM pepsi.history h WHERE h.origin = $1 \
      ORDER BY h.at, h.workqueue_id, h.recipient LIMIT $2";
