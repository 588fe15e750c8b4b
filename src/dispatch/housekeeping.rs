//! The loop's housekeeping (§9, §10): the channel to the thread pool
//! ([`super::background`]) and the state of every chore the loop hands it — statistics
//! flushes (one in flight at most, every `STATS_INTERVAL` and when the pipeline goes
//! idle), the body GC (only after activity), the count of rows at unknown stages, the
//! stages an injecting role may inject into, the reads of a reload (asked for, in
//! flight, retried), and the read of who holds the oldest snapshot with the watch that
//! decides what to log about it ([`super::horizon`]).
//!
//! One owner with verbs, a field of the loop's `Dispatcher`: the loop's event and timer
//! dispatch, the worker handlers ([`super::workers`], which note activity), the reload
//! handler ([`super::reload`]) and shutdown change it only through them. It sends jobs
//! and nothing else; the statistics it flushes are the claim ledger's, taken and handed
//! back through the ledger's own verbs.

use std::path::Path;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use super::background::Job;
use super::horizon::{self, Notice, Watch};
use super::ledger::Ledger;
use super::stats::Deltas;
use super::timers;

/// A reload's own state in the loop.
#[derive(Default)]
struct ReloadRequest {
    /// A reload was asked for.
    want: bool,
    /// The reload's inputs are being read.
    in_flight: bool,
    /// When a reload that could not read its inputs is tried again.
    retry_at: Option<Instant>,
}

/// The housekeeping's state and its verbs.
pub struct Housekeeping {
    jobs: Sender<Job>,
    flush_in_flight: bool,
    /// The last tenants' figures written were not empty.
    shares_written: bool,
    last_flush: Instant,
    next_stats_tick: Instant,
    /// A pass ran since the last body GC (or the last one hit its limit or failed).
    active_since_gc: bool,
    /// The pipeline was busy since the last idle flush.
    was_busy: bool,
    unknown_checked: Instant,
    reload: ReloadRequest,
    /// The oldest-snapshot watch and how often it reads; `None` when
    /// `SNAPSHOT_WARNING` is 0.
    horizon: Option<(Watch, Duration)>,
    /// When the holders were last asked for.
    horizon_checked: Instant,
    /// A read of the holders is in flight.
    horizon_in_flight: bool,
    /// When a failed read was last logged.
    horizon_failure_logged: Option<Instant>,
    /// When the delivery history's upkeep is next due.
    history_due: Instant,
}

impl Housekeeping {
    /// Housekeeping that hands its jobs to `jobs`: the first statistics tick one
    /// `stats_interval` from now, the first count of rows at unknown stages at the
    /// first turn; the first read of who holds the oldest snapshot one check gap from
    /// now (none when `snapshot_warning` is zero).
    pub fn new(
        jobs: Sender<Job>,
        now: Instant,
        stats_interval: Duration,
        snapshot_warning: Duration,
    ) -> Housekeeping {
        Housekeeping {
            jobs,
            flush_in_flight: false,
            shares_written: false,
            last_flush: now,
            next_stats_tick: now + stats_interval,
            active_since_gc: true,
            was_busy: false,
            unknown_checked: now.checked_sub(timers::UNKNOWN_STAGE_GAP).unwrap_or(now),
            reload: ReloadRequest::default(),
            horizon: horizon::check_gap(snapshot_warning)
                .map(|gap| (Watch::new(snapshot_warning), gap)),
            horizon_checked: now,
            horizon_in_flight: false,
            horizon_failure_logged: None,
            history_due: now,
        }
    }

    /// Hands a job to the thread pool (whose channel lives as long as the loop).
    fn send(&self, job: Job) {
        let _ = self.jobs.send(job);
    }

    // ---- statistics and the body GC (§10) ------------------------------------------

    /// A worker pass ran: the next statistics tick runs the body GC.
    pub fn note_active(&mut self) {
        self.active_since_gc = true;
    }

    /// A body GC run ended; `more` when it hit its limit or failed.
    pub fn gc_done(&mut self, more: bool) {
        self.active_since_gc |= more;
    }

    /// Flushes the ledger's statistics, unless there are none or a flush is in flight.
    pub fn flush(&mut self, ledger: &mut Ledger) {
        if self.flush_in_flight {
            return;
        }
        let Some(deltas) = ledger.take_deltas() else {
            return;
        };
        self.flush_in_flight = true;
        self.last_flush = Instant::now();
        self.send(Job::Flush(Box::new(deltas)));
    }

    /// A flush ended. A failed one hands its deltas back to the ledger for the next,
    /// and its error to the caller, to log.
    pub fn flushed(
        &mut self,
        result: Result<(), (String, Box<Deltas>)>,
        ledger: &mut Ledger,
    ) -> Result<(), String> {
        self.flush_in_flight = false;
        result.map_err(|(e, deltas)| {
            ledger.restore_deltas(&deltas);
            e
        })
    }

    /// Is a flush in flight?
    pub fn flush_in_flight(&self) -> bool {
        self.flush_in_flight
    }

    /// The `STATS_INTERVAL` tick: flush, run the body GC after activity, and the
    /// delivery history's upkeep (keeping `history_days`) when it is due.
    pub fn stats_tick(
        &mut self,
        now: Instant,
        interval: Duration,
        ledger: &mut Ledger,
        history_days: i32,
    ) {
        self.next_stats_tick = now + interval;
        self.flush(ledger);
        // The tenants' figures, and once more when they emptied (the table follows).
        let shares = ledger.policy().shares(now);
        if !shares.is_empty() || self.shares_written {
            self.shares_written = !shares.is_empty();
            self.send(Job::Shares(shares));
        }
        if std::mem::take(&mut self.active_since_gc) {
            self.send(Job::BodyGc);
        }
        if now >= self.history_due {
            self.history_due = now + timers::HISTORY_GAP;
            self.send(Job::History(history_days));
        }
    }

    /// Remembers that the pipeline was busy this turn, for the idle flush.
    pub fn note_busy(&mut self, busy: bool) {
        self.was_busy |= busy;
    }

    /// The pipeline went idle: flush the burst's statistics.
    pub fn idle_flush(&mut self, ledger: &mut Ledger) {
        self.was_busy = false;
        self.flush(ledger);
    }

    /// When the idle flush may run: the pipeline was busy and is not now (`busy` is
    /// asked only then), and no flush is in flight; at most once a
    /// [`timers::IDLE_FLUSH_GAP`].
    pub fn idle_flush_at(&self, busy: impl FnOnce() -> bool) -> Option<Instant> {
        (self.was_busy && !busy() && !self.flush_in_flight)
            .then(|| self.last_flush + timers::IDLE_FLUSH_GAP)
    }

    /// The next `STATS_INTERVAL` tick.
    pub fn stats_tick_at(&self) -> Instant {
        self.next_stats_tick
    }

    // ---- rows at unknown stages, entry stages --------------------------------------

    /// Counts the pending rows at stages other than `known`.
    pub fn count_unknown(&mut self, now: Instant, known: Vec<String>) {
        self.unknown_checked = now;
        self.send(Job::UnknownStages(known));
    }

    /// When rows at unknown stages were last counted.
    pub fn unknown_checked(&self) -> Instant {
        self.unknown_checked
    }

    /// Writes the stages an injecting role may inject into.
    pub fn inject_stages(&self, stages: Vec<String>) {
        self.send(Job::InjectStages(stages));
    }

    // ---- the oldest snapshot --------------------------------------------------

    /// Reads who holds the oldest snapshot.
    pub fn check_horizon(&mut self, now: Instant) {
        self.horizon_checked = now;
        self.horizon_in_flight = true;
        self.send(Job::Horizon);
    }

    /// When the holders are read next: `None` when the warning is off or a read is in
    /// flight (its answer sets the next).
    pub fn horizon_check_at(&self) -> Option<Instant> {
        match &self.horizon {
            Some((_, gap)) if !self.horizon_in_flight => Some(self.horizon_checked + *gap),
            _ => None,
        }
    }

    /// The holders arrived (oldest first): what to log, if anything. A failed read
    /// changes nothing; the caller logs its error.
    pub fn horizon_read(
        &mut self,
        holders: &[crate::db::horizon::Holder],
        now: Instant,
    ) -> Option<Notice> {
        self.horizon_in_flight = false;
        self.horizon_checked = now;
        self.horizon.as_mut()?.0.observe(holders, now)
    }

    /// The oldest snapshot's age at the last read of the holders (`None`: none held,
    /// or the reads are off with `SNAPSHOT_WARNING = 0`).
    pub fn oldest_snapshot(&self) -> Option<Duration> {
        self.horizon.as_ref().and_then(|(watch, _)| watch.oldest())
    }

    /// A read of the holders failed: whether to log it (at most once a
    /// [`horizon::WARNING_GAP`], the database may be away for long).
    pub fn horizon_failed(&mut self, now: Instant) -> bool {
        self.horizon_in_flight = false;
        self.horizon_checked = now;
        let log = self
            .horizon_failure_logged
            .is_none_or(|at| now.saturating_duration_since(at) >= horizon::WARNING_GAP);
        if log {
            self.horizon_failure_logged = Some(now);
        }
        log
    }

    // ---- reloads (§9) --------------------------------------------------------------

    /// A reload is asked for (a signal, a notification, a reconnected LISTEN session).
    pub fn want_reload(&mut self) {
        self.reload.want = true;
    }

    /// A reload that could not read its inputs is due again.
    pub fn reload_retry_due(&mut self) {
        self.reload.retry_at = None;
        self.reload.want = true;
    }

    /// When a reload asked for and none in flight: has the thread pool read its inputs,
    /// the overlay and the file at `path`.
    pub fn start_reload(&mut self, path: &Path) {
        if self.reload.want && !self.reload.in_flight {
            self.reload.want = false;
            self.reload.in_flight = true;
            self.send(Job::ReadReload(path.to_path_buf()));
        }
    }

    /// The reload's inputs arrived.
    pub fn reload_read(&mut self) {
        self.reload.in_flight = false;
    }

    /// The reload's inputs could not be read: try again at `at`.
    pub fn retry_reload(&mut self, at: Instant) {
        self.reload.retry_at = Some(at);
    }

    /// When a failed reload is tried again.
    pub fn reload_retry_at(&self) -> Option<Instant> {
        self.reload.retry_at
    }
}
