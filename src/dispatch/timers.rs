//! Every deadline of the loop in one list, made by one pure function from a snapshot of
//! the loop's clocks ([`Clocks`]). The loop uses the same list twice per turn: its
//! earliest entry is the poll timeout, and after the poll the entries that are due are
//! the timer actions — so what the loop sleeps for and what it acts on cannot drift.
//!
//! A deadline whose action is blocked (a claim or flip in flight, the lock lost) is left
//! out, so the loop sleeps until the event that unblocks it instead of spinning.
//!
//! Called by the loop ([`super::event_loop`]), which fills the snapshot from its
//! owners; pure: it changes nothing, and the owners use only its types and constants.

use std::time::{Duration, Instant};

/// How long a worker may take to exit after its stdin was closed before it is killed.
pub const CLOSE_GRACE: Duration = Duration::from_secs(10);
/// The idle statistics flush happens at most this often.
pub const IDLE_FLUSH_GAP: Duration = Duration::from_secs(1);
/// Rows at unknown stages are counted at most this often.
pub const UNKNOWN_STAGE_GAP: Duration = Duration::from_secs(60);
/// How often the delivery history's upkeep runs (`pepsi.history_maintain`: the next
/// days' partitions, expired days dropped); the first at the first statistics tick.
pub const HISTORY_GAP: Duration = Duration::from_secs(3600);

/// What is due.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Due {
    /// A worker's front message ran past MAX_RUNTIME (worker serial).
    Hang(u64),
    /// A worker was not ready within MAX_RUNTIME.
    StartTimeout(u64),
    /// A worker whose stdin was closed has not exited within [`CLOSE_GRACE`].
    StuckClosing(u64),
    /// A ready worker has been idle for WORKER_IDLE_TIMEOUT.
    Idle(u64),
    /// A stage's start-failure cooldown ends.
    CooldownEnd(String),
    /// A stage's overload throttle window ends.
    ThrottleEnd(String),
    /// A stage's backoff after a 75 ends: it may claim again.
    OverloadEnd(String),
    /// Rows deferred for 74 wait to be resumed (at least a second after the deferral).
    DeferredResume,
    /// A wake-up asked for a claim.
    Claim,
    /// The heartbeat claim (POLL_INTERVAL).
    Heartbeat,
    /// A claim that failed is tried again.
    ClaimRetry,
    /// The earliest paused row is due.
    PausedDue,
    /// A reload that could not read the configuration is tried again.
    ReloadRetry,
    /// The statistics flush and body GC tick (STATS_INTERVAL).
    StatsTick,
    /// The pipeline went idle: flush the burst's statistics.
    IdleFlush,
    /// Count rows at stages without a section.
    UnknownStages,
    /// Read who holds the database's oldest snapshot.
    Horizon,
}

/// One deadline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deadline {
    /// When.
    pub at: Instant,
    /// What.
    pub due: Due,
}

/// One worker's clocks.
#[derive(Clone, Debug)]
pub struct WorkerClock {
    /// Its serial.
    pub serial: u64,
    /// Started and not yet ready.
    pub starting: bool,
    /// When it was started.
    pub started: Instant,
    /// When its front message reached the head of its queue.
    pub front_since: Option<Instant>,
    /// Ready with nothing to do since then.
    pub idle_since: Option<Instant>,
    /// Its stdin was closed then.
    pub closing_since: Option<Instant>,
}

/// A stage's clocks.
#[derive(Clone, Debug, Default)]
pub struct StageClock {
    /// The stage.
    pub name: String,
    /// When its start-failure cooldown ends.
    pub cooldown: Option<Instant>,
    /// When its overload throttle window ends.
    pub throttle: Option<Instant>,
    /// When its backoff after a 75 ends.
    pub overload: Option<Instant>,
}

/// A snapshot of every clock of the loop.
#[derive(Clone, Debug)]
pub struct Clocks {
    /// Now.
    pub now: Instant,
    /// MAX_RUNTIME.
    pub max_runtime: Duration,
    /// WORKER_IDLE_TIMEOUT.
    pub idle_timeout: Duration,
    /// POLL_INTERVAL.
    pub poll_interval: Duration,
    /// Every worker.
    pub workers: Vec<WorkerClock>,
    /// Every stage with a cooldown or throttle.
    pub stages: Vec<StageClock>,
    /// A claim may be sent (the lock is held, none is in flight).
    pub can_claim: bool,
    /// A wake-up asked for a claim.
    pub want_claim: bool,
    /// When the last claim was sent.
    pub last_claim: Instant,
    /// When a failed claim is retried.
    pub claim_retry: Option<Instant>,
    /// When the earliest paused row is due, if a flip may be sent.
    pub paused_due: Option<Instant>,
    /// When a failed reload is retried.
    pub reload_retry: Option<Instant>,
    /// When the earliest row deferred for 74 may be resumed.
    pub deferred_resume: Option<Instant>,
    /// The next STATS_INTERVAL tick.
    pub stats_tick: Instant,
    /// When the idle flush may run, if the pipeline just went idle.
    pub idle_flush: Option<Instant>,
    /// When rows at unknown stages were last counted.
    pub unknown_checked: Instant,
    /// When the holders of the oldest snapshot are read next (`None`: the warning is
    /// off, or a read is in flight).
    pub horizon_check: Option<Instant>,
}

/// Every deadline, in the order the loop acts on those that are due (a worker's hang
/// before its other clocks, workers before stages, the claim last).
pub fn deadlines(c: &Clocks) -> Vec<Deadline> {
    let mut list = Vec::new();
    let mut at = |at: Instant, due: Due| list.push(Deadline { at, due });
    for w in &c.workers {
        if w.starting {
            at(w.started + c.max_runtime, Due::StartTimeout(w.serial));
            continue;
        }
        if let Some(t) = w.front_since {
            at(t + c.max_runtime, Due::Hang(w.serial));
        }
        if let Some(t) = w.closing_since {
            at(t + CLOSE_GRACE, Due::StuckClosing(w.serial));
        }
        if let Some(t) = w.idle_since {
            at(t + c.idle_timeout, Due::Idle(w.serial));
        }
    }
    for s in &c.stages {
        if let Some(t) = s.cooldown {
            at(t, Due::CooldownEnd(s.name.clone()));
        }
        if let Some(t) = s.throttle {
            at(t, Due::ThrottleEnd(s.name.clone()));
        }
        if let Some(t) = s.overload {
            at(t, Due::OverloadEnd(s.name.clone()));
        }
    }
    if let Some(t) = c.deferred_resume {
        at(t, Due::DeferredResume);
    }
    if let Some(t) = c.paused_due {
        at(t, Due::PausedDue);
    }
    if let Some(t) = c.reload_retry {
        at(t, Due::ReloadRetry);
    }
    at(c.stats_tick, Due::StatsTick);
    if let Some(t) = c.idle_flush {
        at(t, Due::IdleFlush);
    }
    at(c.unknown_checked + UNKNOWN_STAGE_GAP, Due::UnknownStages);
    if let Some(t) = c.horizon_check {
        at(t, Due::Horizon);
    }
    if c.can_claim {
        at(c.last_claim + c.poll_interval, Due::Heartbeat);
        if let Some(t) = c.claim_retry {
            at(t, Due::ClaimRetry);
        }
        if c.want_claim {
            at(c.now, Due::Claim);
        }
    }
    list
}

/// The earliest deadline: when the loop must wake up at the latest.
pub fn next_wake(list: &[Deadline]) -> Option<Instant> {
    list.iter().map(|d| d.at).min()
}

/// The deadlines due at `now`, in list order.
pub fn due(list: Vec<Deadline>, now: Instant) -> impl Iterator<Item = Due> {
    list.into_iter().filter(move |d| d.at <= now).map(|d| d.due)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clocks(now: Instant) -> Clocks {
        Clocks {
            now,
            max_runtime: Duration::from_secs(300),
            idle_timeout: Duration::from_secs(5),
            poll_interval: Duration::from_secs(30),
            workers: Vec::new(),
            stages: Vec::new(),
            can_claim: true,
            want_claim: false,
            last_claim: now,
            claim_retry: None,
            paused_due: None,
            reload_retry: None,
            deferred_resume: None,
            stats_tick: now + Duration::from_secs(60),
            idle_flush: None,
            unknown_checked: now,
            horizon_check: None,
        }
    }

    fn worker(serial: u64, now: Instant) -> WorkerClock {
        WorkerClock {
            serial,
            starting: false,
            started: now,
            front_since: None,
            idle_since: None,
            closing_since: None,
        }
    }

    #[test]
    fn the_wake_up_is_the_earliest_deadline_and_only_due_ones_act() {
        let now = Instant::now();
        let mut c = clocks(now);
        let mut busy = worker(1, now);
        busy.front_since = Some(now - Duration::from_secs(299));
        let mut idle = worker(2, now);
        idle.idle_since = Some(now - Duration::from_secs(10));
        c.workers = vec![busy, idle];
        let list = deadlines(&c);
        assert_eq!(next_wake(&list), Some(now - Duration::from_secs(5)));
        assert_eq!(
            due(list.clone(), now).collect::<Vec<_>>(),
            vec![Due::Idle(2)]
        );
        let later = now + Duration::from_secs(1);
        assert_eq!(
            due(list, later).collect::<Vec<_>>(),
            vec![Due::Hang(1), Due::Idle(2)]
        );
    }

    #[test]
    fn a_starting_worker_has_only_its_start_deadline() {
        let now = Instant::now();
        let mut c = clocks(now);
        let mut w = worker(7, now - Duration::from_secs(301));
        w.starting = true;
        w.front_since = Some(now);
        w.idle_since = Some(now - Duration::from_secs(100));
        c.workers = vec![w];
        assert_eq!(
            due(deadlines(&c), now).collect::<Vec<_>>(),
            vec![Due::StartTimeout(7)]
        );
    }

    #[test]
    fn blocked_claims_leave_no_deadline_so_the_loop_does_not_spin() {
        let now = Instant::now();
        let mut c = clocks(now);
        c.want_claim = true;
        c.claim_retry = Some(now);
        c.last_claim = now - Duration::from_secs(60);
        let due_now: Vec<Due> = due(deadlines(&c), now).collect();
        assert_eq!(due_now, vec![Due::Heartbeat, Due::ClaimRetry, Due::Claim]);
        c.can_claim = false;
        let list = deadlines(&c);
        assert!(due(list.clone(), now).next().is_none());
        assert_eq!(next_wake(&list), Some(now + Duration::from_secs(60)));
    }

    #[test]
    fn stage_clocks_and_the_rest_are_listed() {
        let now = Instant::now();
        let mut c = clocks(now);
        c.stages = vec![StageClock {
            name: "relay".into(),
            cooldown: Some(now),
            throttle: Some(now + Duration::from_secs(9)),
            overload: Some(now + Duration::from_millis(100)),
        }];
        c.paused_due = Some(now);
        c.deferred_resume = Some(now + Duration::from_secs(1));
        c.reload_retry = Some(now + Duration::from_secs(1));
        c.idle_flush = Some(now);
        c.horizon_check = Some(now + Duration::from_secs(15));
        let list = deadlines(&c);
        assert_eq!(
            due(list.clone(), now).collect::<Vec<_>>(),
            vec![
                Due::CooldownEnd("relay".into()),
                Due::PausedDue,
                Due::IdleFlush
            ]
        );
        assert!(
            list.iter()
                .any(|d| d.due == Due::ThrottleEnd("relay".into()))
        );
        assert!(list.iter().any(|d| d.due == Due::UnknownStages));
        assert!(
            list.iter()
                .any(|d| d.due == Due::OverloadEnd("relay".into()))
        );
        assert!(list.iter().any(|d| d.due == Due::DeferredResume));
        assert!(list.iter().any(|d| d.due == Due::StatsTick));
        assert!(list.iter().any(|d| d.due == Due::Horizon));
    }
}
