//! The engine thread: it owns the session, takes submissions from the HTTP
//! handlers, steps while there is work and routes each event to the
//! handler that asked for it. Handlers never touch the session; they cancel
//! through its lock-free [`Canceller`], which interrupts a running step.

use crate::metrics::Metrics;
use nanoinfer::engine::{
    Canceller, Event, FinishReason, Model, RequestId, RequestParams, Session, SessionParams,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;
use tokio::sync::{mpsc as tmpsc, oneshot};

/// Requests accepted per choice of a submission, at most (`n`).
pub const MAX_CHOICES: usize = 16;

/// What a submission gets back: the ids of its requests, or why the
/// session refused them (nothing of it is left in the session then).
pub type SubmitReply = Result<Vec<RequestId>, nanoinfer::Error>;

enum Command {
    Submit {
        requests: Vec<RequestParams>,
        arrived: Instant,
        events: tmpsc::UnboundedSender<Event>,
        reply: oneshot::Sender<SubmitReply>,
    },
    /// Cancel every request (the end of a graceful shutdown).
    CancelAll,
}

/// Where the events of one request go, and its timing for the metrics.
struct Route {
    events: tmpsc::UnboundedSender<Event>,
    arrived: Instant,
    last_token: Option<Instant>,
}

/// Fixed facts about the session, known once it is built.
#[derive(Clone, Copy, Debug)]
pub struct SessionFacts {
    /// Prompt plus `max_tokens` of one request, at most.
    pub request_token_limit: usize,
    pub max_seqs: usize,
}

/// The HTTP side's handle on the engine thread. Cheap to clone.
#[derive(Clone)]
pub struct EngineHandle {
    commands: mpsc::Sender<Command>,
    canceller: Canceller,
    admission: Arc<Admission>,
    pub model: Arc<Model>,
    pub facts: SessionFacts,
}

/// The bounded queue: requests accepted and not yet ended, against a limit.
pub struct Admission {
    in_flight: AtomicUsize,
    limit: usize,
    draining: AtomicBool,
}

/// Why a submission was not taken.
pub enum Refusal {
    /// The queue is full: try again later.
    Full,
    /// The server is shutting down.
    Draining,
    /// The session refused the requests (bad parameters, too long).
    Session(nanoinfer::Error),
    /// The engine thread is gone.
    Stopped,
}

impl EngineHandle {
    /// Builds the session on a new engine thread and starts its loop.
    pub fn start(
        model: Arc<Model>,
        params: SessionParams,
        max_queue: Option<usize>,
        metrics: Arc<Metrics>,
    ) -> Result<EngineHandle, String> {
        let (commands, inbox) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread_model = model.clone();
        // The queue's limit depends on the session's shape, known once the
        // engine thread has built it.
        let (limit_tx, limit_rx) = mpsc::channel::<Arc<Admission>>();
        std::thread::Builder::new()
            .name("nanoinfer-engine".into())
            .spawn(move || {
                let session = match Session::new(thread_model, params) {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let facts = SessionFacts {
                    request_token_limit: session.request_token_limit(),
                    max_seqs: session.params().max_seqs,
                };
                let _ = ready_tx.send(Ok((session.canceller(), facts)));
                let Ok(admission) = limit_rx.recv() else {
                    return;
                };
                EngineLoop {
                    session,
                    routes: HashMap::new(),
                    admission,
                    metrics,
                }
                .run(inbox);
            })
            .map_err(|e| format!("cannot start the engine thread: {e}"))?;
        let (canceller, facts) = ready_rx
            .recv()
            .map_err(|_| "the engine thread ended while building the session".to_string())??;
        let limit = facts
            .max_seqs
            .saturating_add(max_queue.unwrap_or(4 * facts.max_seqs));
        let admission = Arc::new(Admission {
            in_flight: AtomicUsize::new(0),
            limit,
            draining: AtomicBool::new(false),
        });
        let _ = limit_tx.send(admission.clone());
        Ok(EngineHandle {
            commands,
            canceller,
            admission,
            model,
            facts,
        })
    }

    /// Submits the requests of one HTTP request (one per choice); their
    /// events arrive on the returned receiver, each request ending with
    /// exactly one terminal event. Refused whole when the queue lacks room
    /// for all of them.
    pub async fn submit(
        &self,
        requests: Vec<RequestParams>,
        arrived: Instant,
    ) -> Result<Submission, Refusal> {
        let n = requests.len();
        self.admission.acquire(n)?;
        let (events_tx, events) = tmpsc::unbounded_channel();
        let (reply_tx, reply_rx) = oneshot::channel();
        let sent = self.commands.send(Command::Submit {
            requests,
            arrived,
            events: events_tx,
            reply: reply_tx,
        });
        if sent.is_err() {
            self.admission.release(n);
            return Err(Refusal::Stopped);
        }
        // The engine thread releases the places of refused requests itself.
        match reply_rx.await {
            Ok(Ok(ids)) => Ok(Submission {
                guard: CancelOnDrop {
                    canceller: self.canceller.clone(),
                    open: ids.clone(),
                },
                ids,
                events,
            }),
            Ok(Err(e)) => Err(Refusal::Session(e)),
            Err(_) => Err(Refusal::Stopped),
        }
    }

    /// From now on submissions are refused as draining.
    pub fn start_draining(&self) {
        self.admission.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.admission.draining.load(Ordering::SeqCst)
    }

    /// Cancels every request in the session.
    pub fn cancel_all(&self) {
        let _ = self.commands.send(Command::CancelAll);
    }

    /// Requests accepted and not yet ended.
    pub fn in_flight(&self) -> usize {
        self.admission.in_flight.load(Ordering::SeqCst)
    }
}

impl Admission {
    fn acquire(&self, n: usize) -> Result<(), Refusal> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(Refusal::Draining);
        }
        self.in_flight
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |cur| {
                (cur + n <= self.limit).then_some(cur + n)
            })
            .map(|_| ())
            .map_err(|_| Refusal::Full)
    }

    fn release(&self, n: usize) {
        self.in_flight.fetch_sub(n, Ordering::SeqCst);
    }
}

/// The requests of one submission and their events.
pub struct Submission {
    pub ids: Vec<RequestId>,
    pub events: tmpsc::UnboundedReceiver<Event>,
    guard: CancelOnDrop,
}

impl Submission {
    /// The next event of any of its requests; `None` once all have ended.
    pub async fn next(&mut self) -> Option<Event> {
        if self.guard.open.is_empty() {
            return None;
        }
        let event = self.events.recv().await?;
        if event.finish.is_some() {
            self.guard.open.retain(|&id| id != event.request_id);
        }
        Some(event)
    }

    /// Cancels the requests still running (their terminal events follow).
    pub fn cancel(&mut self) {
        self.guard.cancel_open();
    }

    /// Which choice a request is.
    pub fn index_of(&self, id: RequestId) -> usize {
        self.ids.iter().position(|&i| i == id).unwrap_or(0)
    }
}

/// Cancels the requests of a submission whose handler goes away before they
/// end: the client disconnected, or the handler failed. The cancel takes
/// effect at once (it interrupts a running step), not at the next event.
struct CancelOnDrop {
    canceller: Canceller,
    open: Vec<RequestId>,
}

impl CancelOnDrop {
    fn cancel_open(&mut self) {
        for &id in &self.open {
            // Refused only when the request ended meanwhile: nothing to do.
            let _ = self.canceller.cancel(id);
        }
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.cancel_open();
    }
}

struct EngineLoop {
    session: Session,
    routes: HashMap<RequestId, Route>,
    admission: Arc<Admission>,
    metrics: Arc<Metrics>,
}

impl EngineLoop {
    /// Runs until the handles are gone and every request has ended.
    fn run(mut self, inbox: mpsc::Receiver<Command>) {
        let mut events = Vec::new();
        let mut open = true;
        loop {
            if !self.session.has_work() {
                self.metrics.observe_idle(&self.session.stats());
                if !open {
                    return;
                }
                // Idle: sleep until a handler submits something.
                match inbox.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => return,
                }
            }
            while open {
                match inbox.try_recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => open = false,
                }
            }
            if !self.session.has_work() {
                continue;
            }
            if let Err(e) = self.session.step_into(&mut events) {
                // Only an abort check fails a step, and this loop sets none.
                eprintln!("nanoinfer serve: step failed: {e}");
                continue;
            }
            let now = Instant::now();
            for event in events.iter() {
                self.route(event, now);
            }
            self.metrics.observe_step(&self.session.stats());
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit {
                requests,
                arrived,
                events,
                reply,
            } => {
                let n = requests.len();
                let mut ids = Vec::with_capacity(n);
                let mut refused = None;
                for params in requests {
                    match self.session.add_request_at(params, arrived) {
                        Ok(id) => ids.push(id),
                        Err(e) => {
                            refused = Some(e);
                            break;
                        }
                    }
                }
                // Routed even when refused: requests added before the
                // refusal are cancelled, and their terminal events free
                // their places in the queue like any other.
                for &id in &ids {
                    self.routes.insert(
                        id,
                        Route {
                            events: events.clone(),
                            arrived,
                            last_token: None,
                        },
                    );
                }
                self.metrics.requests_accepted(ids.len());
                let answer = match refused {
                    Some(e) => {
                        self.admission.release(n - ids.len());
                        Err(e)
                    }
                    None => Ok(ids.clone()),
                };
                // All or none: when refused, or when the handler is gone
                // already, the requests added end here.
                let was_refused = answer.is_err();
                let handler_gone = reply.send(answer).is_err();
                if was_refused || handler_gone {
                    for id in ids {
                        let _ = self.session.cancel(id);
                    }
                }
            }
            Command::CancelAll => {
                let ids: Vec<RequestId> = self.routes.keys().copied().collect();
                for id in ids {
                    let _ = self.session.cancel(id);
                }
            }
        }
    }

    fn route(&mut self, event: &Event, now: Instant) {
        let Some(route) = self.routes.get_mut(&event.request_id) else {
            return;
        };
        if !event.tokens.is_empty() {
            match route.last_token {
                None => self
                    .metrics
                    .observe_first_token(now.duration_since(route.arrived)),
                Some(last) => self
                    .metrics
                    .observe_inter_token(now.duration_since(last), event.tokens.len()),
            }
            route.last_token = Some(now);
            self.metrics.generated_tokens(event.tokens.len());
        }
        let delivered = route.events.send(event.clone()).is_ok();
        if let Some(reason) = &event.finish {
            let route = self.routes.remove(&event.request_id).expect("routed above");
            self.admission.release(1);
            self.metrics.request_finished(
                reason,
                event.usage.unwrap_or_default(),
                now.duration_since(route.arrived),
            );
        } else if !delivered {
            // The handler is gone without cancelling (it always cancels on
            // drop; this is the backstop).
            let _ = self.session.cancel(event.request_id);
        }
    }
}

/// The OpenAI name of how a request ended.
pub fn finish_reason_name(reason: &FinishReason) -> &'static str {
    match reason {
        FinishReason::Cancelled => "abort",
        other => other.as_str(),
    }
}
