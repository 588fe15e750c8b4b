//! What a worker's end means for the messages it held (§8.1, §8.2): a pure function
//! from the facts of a death — how it ended, where the worker was in its life, which
//! of its ids had reached its stdin pipe — to a [`Verdict`]: who is struck, what goes
//! back to pending, which ids become suspects, whether the stage cools down.
//!
//! The worker handlers ([`super::workers`]) record the facts ([`Death`]) and apply the
//! verdict; nothing here does I/O or touches any state, so every rule is unit-tested
//! without processes or a database.

use std::time::{Duration, Instant};

use super::claim::{Claim, StrikeKind};
use super::pool::Cooldown;

/// How a worker went away.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum End {
    /// Its stdout closed (it exited or crashed).
    Eof,
    /// It said something unreadable.
    Garbage(String),
    /// Its front message ran past MAX_RUNTIME and it was killed.
    Hang,
    /// It was not ready within MAX_RUNTIME and was killed.
    StartTimeout,
    /// Its pipe failed, or it did not exit after its input ended.
    Crash(String),
}

/// One id the worker held when it went away.
#[derive(Clone, Debug)]
pub struct Held {
    /// The claim.
    pub claim: Claim,
    /// Did its whole line reach the worker's stdin pipe?
    pub delivered: bool,
    /// When it reached the head of the worker's queue.
    pub head_since: Option<Instant>,
}

/// The facts of a worker's end.
#[derive(Clone, Debug)]
pub struct Death {
    /// Its pid, for the reasons given.
    pub pid: u32,
    /// How it ended.
    pub end: End,
    /// It had printed `ready`.
    pub was_ready: bool,
    /// Its stdin had been closed (a retirement or an idle stop).
    pub was_closing: bool,
    /// How many ids it answered.
    pub answered: u64,
    /// Its exit code, when it exited.
    pub exit_code: Option<i32>,
    /// The signal that ended it, when one did.
    pub exit_signal: Option<i32>,
    /// How it ended, in words ("exited with status 3").
    pub exit_text: String,
    /// The ids it held, front first.
    pub held: Vec<Held>,
    /// The dispatcher is shutting down (a signal meant for it may have reached the
    /// worker too).
    pub stopping: bool,
    /// MAX_RUNTIME, for the reasons given.
    pub max_runtime: Duration,
    /// Now, to measure the front's time.
    pub now: Instant,
}

/// What the death means.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// It failed at its own start (before `ready`, or exit 78 before any answer): no
    /// message is blamed, every id goes back, the stage cools down (§8.1).
    StartFailure {
        /// Why, for the log.
        cause: String,
        /// Back to pending.
        back: Vec<Claim>,
        /// How the stage cools down.
        cooldown: Cooldown,
    },
    /// It exited 75 before answering anything: the database refused it a connection
    /// for overload. Not a start failure: every id goes back, the biggest stage is
    /// throttled and the stage backs off (§8.3).
    Overload {
        /// Back to pending.
        back: Vec<Claim>,
    },
    /// It held nothing. `log` when that is worth a warning (it was not being stopped).
    Idle {
        /// The warning.
        log: Option<String>,
    },
    /// The dispatcher is stopping: nobody is blamed; the shutdown reset puts the rows
    /// back.
    Stopping {
        /// The claims it held.
        held: Vec<Claim>,
    },
    /// Its front id never reached it: not its fault; everything goes back.
    Unread {
        /// Back to pending.
        back: Vec<Claim>,
    },
    /// It had more than one id delivered, any of which may have killed it (a batching
    /// stage runs them together): nobody is struck; the delivered ids go back as
    /// suspects, each to run alone next time so the next death names the culprit
    /// (§8.2 "Batches").
    Suspects {
        /// Why it died, for the log.
        reason: String,
        /// Delivered ids: back to pending, to run alone.
        suspects: Vec<Claim>,
        /// Ids it never read: back to pending.
        back: Vec<Claim>,
    },
    /// Its front was the only id delivered: the front is struck, the rest go back.
    Strike {
        /// The struck claim.
        front: Claim,
        /// Crash or hang.
        kind: StrikeKind,
        /// For `state.last_error` and the log.
        reason: String,
        /// How long the front was at the head.
        took: Duration,
        /// Ids it never read: back to pending.
        back: Vec<Claim>,
    },
}

fn claims(held: Vec<Held>) -> Vec<Claim> {
    held.into_iter().map(|h| h.claim).collect()
}

/// Judges a worker's end.
pub fn judge(death: Death) -> Verdict {
    let Death {
        pid,
        end,
        was_ready,
        was_closing,
        answered,
        exit_code,
        exit_signal,
        exit_text,
        held,
        stopping,
        max_runtime,
        now,
    } = death;
    if answered == 0 && exit_code == Some(75) {
        return Verdict::Overload { back: claims(held) };
    }
    let refused = answered == 0 && exit_code == Some(78);
    if !was_ready || refused {
        // Killed from outside (an administrator, the OOM killer) before it could
        // start: nobody's fault, and no reason to hold the stage long.
        let outside = end == End::Eof
            && matches!(
                exit_signal,
                Some(libc::SIGKILL | libc::SIGTERM | libc::SIGINT | libc::SIGHUP)
            );
        let cooldown = if outside {
            Cooldown::Brief
        } else if exit_code == Some(74) {
            Cooldown::Database
        } else {
            Cooldown::Growing
        };
        let cause = match &end {
            End::Garbage(what) => format!("printed {what}"),
            End::StartTimeout => format!(
                "was not ready within {}s and was killed",
                max_runtime.as_secs()
            ),
            _ if refused => {
                "refused to run (exit 78: schema or configuration mismatch; its stderr says why)"
                    .into()
            }
            _ => exit_text,
        };
        let when = if was_ready {
            "before answering anything"
        } else {
            "before it was ready"
        };
        return Verdict::StartFailure {
            cause: format!("worker pid {pid} {cause} {when}"),
            back: claims(held),
            cooldown,
        };
    }
    if held.is_empty() {
        let log = (!was_closing).then(|| format!("idle worker pid {pid} {exit_text}"));
        return Verdict::Idle { log };
    }
    if stopping {
        return Verdict::Stopping { held: claims(held) };
    }
    if !held[0].delivered {
        return Verdict::Unread { back: claims(held) };
    }
    let (kind, reason) = match &end {
        End::Hang => (
            StrikeKind::TimedOut,
            format!(
                "no answer within MAX_RUNTIME ({}s); worker pid {pid} killed",
                max_runtime.as_secs()
            ),
        ),
        End::Garbage(what) => (
            StrikeKind::Crashed,
            format!("worker pid {pid} sent {what} and was torn down"),
        ),
        End::Crash(what) => (
            StrikeKind::Crashed,
            format!("worker pid {pid} failed: {what}"),
        ),
        End::Eof | End::StartTimeout => {
            (StrikeKind::Crashed, format!("worker pid {pid} {exit_text}"))
        }
    };
    let (delivered, back): (Vec<Held>, Vec<Held>) = held.into_iter().partition(|h| h.delivered);
    if delivered.len() > 1 {
        return Verdict::Suspects {
            reason,
            suspects: claims(delivered),
            back: claims(back),
        };
    }
    let front = delivered
        .into_iter()
        .next()
        .expect("the front was delivered");
    Verdict::Strike {
        took: front
            .head_since
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t)),
        front: front.claim,
        kind,
        reason,
        back: claims(back),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(id: i64) -> Claim {
        Claim {
            id,
            stage: "s".into(),
            sender_key: "from:x".into(),
            tenant_key: String::new(),
            token: 1,
            claimed_at: Instant::now(),
        }
    }

    fn death(end: End, delivered: &[bool]) -> Death {
        let now = Instant::now();
        Death {
            pid: 42,
            end,
            was_ready: true,
            was_closing: false,
            answered: 3,
            exit_code: Some(3),
            exit_signal: None,
            exit_text: "exited with status 3".into(),
            held: delivered
                .iter()
                .enumerate()
                .map(|(i, &d)| Held {
                    claim: claim(i as i64 + 1),
                    delivered: d,
                    head_since: (i == 0 && d).then(|| now - Duration::from_secs(2)),
                })
                .collect(),
            stopping: false,
            max_runtime: Duration::from_secs(300),
            now,
        }
    }

    fn ids(claims: &[Claim]) -> Vec<i64> {
        claims.iter().map(|c| c.id).collect()
    }

    #[test]
    fn a_lone_delivered_front_is_struck_and_the_unread_rest_goes_back() {
        match judge(death(End::Eof, &[true, false, false])) {
            Verdict::Strike {
                front,
                kind,
                reason,
                took,
                back,
            } => {
                assert_eq!(front.id, 1);
                assert_eq!(kind, StrikeKind::Crashed);
                assert!(reason.contains("exited with status 3"), "{reason}");
                assert_eq!(took, Duration::from_secs(2));
                assert_eq!(ids(&back), vec![2, 3]);
            }
            other => panic!("{other:?}"),
        }
        match judge(death(End::Hang, &[true])) {
            Verdict::Strike { kind, reason, .. } => {
                assert_eq!(kind, StrikeKind::TimedOut);
                assert!(reason.contains("MAX_RUNTIME (300s)"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_death_with_several_ids_delivered_strikes_nobody() {
        for end in [End::Eof, End::Hang, End::Garbage("\"x\"".into())] {
            match judge(death(end, &[true, true, true, false])) {
                Verdict::Suspects { suspects, back, .. } => {
                    assert_eq!(ids(&suspects), vec![1, 2, 3]);
                    assert_eq!(ids(&back), vec![4]);
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn an_undelivered_front_blames_nobody() {
        match judge(death(End::Crash("broken pipe".into()), &[false, false])) {
            Verdict::Unread { back } => assert_eq!(ids(&back), vec![1, 2]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_start_failure_or_an_early_78_blames_nobody() {
        let mut d = death(End::Eof, &[true, true]);
        d.was_ready = false;
        match judge(d) {
            Verdict::StartFailure {
                cause,
                back,
                cooldown,
            } => {
                assert!(cause.contains("before it was ready"), "{cause}");
                assert_eq!(ids(&back), vec![1, 2]);
                assert_eq!(cooldown, Cooldown::Growing);
            }
            other => panic!("{other:?}"),
        }
        let mut d = death(End::Eof, &[true]);
        d.answered = 0;
        d.exit_code = Some(78);
        match judge(d) {
            Verdict::StartFailure { cause, .. } => {
                assert!(cause.contains("refused to run"), "{cause}");
                assert!(cause.contains("before answering anything"), "{cause}");
            }
            other => panic!("{other:?}"),
        }
        // 78 after answering is an ordinary crash.
        let mut d = death(End::Eof, &[true]);
        d.exit_code = Some(78);
        assert!(matches!(judge(d), Verdict::Strike { .. }));
    }

    #[test]
    fn an_early_75_is_overload_an_outside_kill_is_brief_and_an_early_74_is_the_database() {
        let mut d = death(End::Eof, &[true]);
        d.was_ready = false;
        d.answered = 0;
        d.exit_code = Some(75);
        assert!(matches!(judge(d.clone()), Verdict::Overload { back } if back.len() == 1));
        d.was_ready = true;
        assert!(matches!(judge(d.clone()), Verdict::Overload { .. }));
        d.was_ready = false;
        d.exit_code = None;
        d.exit_signal = Some(libc::SIGKILL);
        assert!(matches!(
            judge(d.clone()),
            Verdict::StartFailure {
                cooldown: Cooldown::Brief,
                ..
            }
        ));
        // Killed by us (a start timeout) or by its own fault: the growing cooldown.
        d.end = End::StartTimeout;
        assert!(matches!(
            judge(d.clone()),
            Verdict::StartFailure {
                cooldown: Cooldown::Growing,
                ..
            }
        ));
        d.end = End::Eof;
        d.exit_signal = Some(libc::SIGSEGV);
        assert!(matches!(
            judge(d.clone()),
            Verdict::StartFailure {
                cooldown: Cooldown::Growing,
                ..
            }
        ));
        d.exit_signal = None;
        d.exit_code = Some(74);
        assert!(matches!(
            judge(d),
            Verdict::StartFailure {
                cooldown: Cooldown::Database,
                ..
            }
        ));
    }

    #[test]
    fn stopping_or_idle_blames_nobody() {
        let mut d = death(End::Eof, &[true]);
        d.stopping = true;
        assert!(matches!(judge(d), Verdict::Stopping { held } if held.len() == 1));
        assert!(matches!(
            judge(death(End::Eof, &[])),
            Verdict::Idle { log: Some(_) }
        ));
        let mut d = death(End::Eof, &[]);
        d.was_closing = true;
        assert_eq!(judge(d), Verdict::Idle { log: None });
    }
}
