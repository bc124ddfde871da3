//! One integration test binary (as ripgrep does), every test against the real engine through
//! the real binary and a real MCP client.
#![allow(unreachable_pub)] // a test crate: its helpers are shared between its modules

// The harness: spawn the server, call tools, check what is left in Docker.
mod common;
// Running code: state, output capture, errors, timeouts, cancellation, restarts.
mod executor;
// Bad input: each a clear tool error, no container made for nothing.
mod input;
// Session lifecycle: isolation, listing, reset, close, idle reaping, sweeps, shutdown.
mod lifecycle;
// Liveness across servers: another state dir, a missing lock, a killed server's heartbeat.
mod liveness;
// Dependency layers: installs, cache hits, live installs, failures.
mod deps;
// The installer: uv, pip fallback, the download cache, wheels only, the datascience environment.
mod installer;
// The workspace: files, run_file, save_as, resources, figures, environment variables.
mod workspace;
// Long-running work: live output, jobs, cancellation, busy queue, per-run figures.
mod jobs;
// The HTTP service: tokens, principals, streaming, healthz.
mod http;
mod http_abuse; // The HTTP service under attack: foreign MCP sessions, caps, Host/Origin, slow clients.
mod http_fair; // Fair admission: a few client addresses cannot take every connection.
mod http_tenants; // Two principals racing for their caps: sessions and jobs created at once.
mod metrics;
mod oauth; // OAuth 2.1 resource server: JWTs against a JWKS the test serves, rotation, kid floods.
mod tls_upstream; // Code mode over https: a TLS upstream trusted through the CA bundle, a stranger refused. // Prometheus: a real one scrapes a core suite; labels stay bounded.
// Environments: Python versions, operator environments, mounts.
mod environments;
// The CI runner, `pyberth run`.
mod cli;
mod cli_state; // The default state dir: one another user made first does not stop a start.
// The first hour: the CLI's own lines, the HTTP front door, a plain log and a clean stop.
mod first_hour;
// Hostile code: exhaustion, protocol abuse, isolation probes, with the four checks.
mod hostile;
// Code that speaks as the agent: forged images and notices, its stderr, FIFOs, slow reprs.
mod hostile_agent;
// Faults outside the code: containers removed mid-run, load beside a canary, bad MCP lines.
mod faults;
// Hardening seen from inside the sandbox.
mod sandbox;
// A client that reads slowly: live output never holds up the run.
mod slow_client;
// Sessions that outlive their server: restarts, kill -9, dropped exec streams, the grace.
mod adopt;
// Each way a session changes its container (wake, fork, restore, OOM), then a restart.
mod adopt_transitions;
// Orphans: a sandbox whose server went stops after the grace and wakes with its state.
mod orphan;
// Terminal states: every end and loss of state has a reason, in the next result and the list.
mod ended;
// Background jobs across restarts: one that woke its session, one finished before the stop.
mod adopt_jobs;
// MCP Tasks over jobs: a declared client's task, polled, cancelled, read across a restart.
mod tasks;
// Adoption under attack: an impostor keeper answers the next server's reattach.
mod adopt_forged;
// Controlled egress: the filtering proxy, its allow-lists, and what a session cannot reach.
mod egress;
// Egress under attack from its own sessions: refusal floods.
mod egress_abuse;
// The audit log: one line per event, bounded under a flood, never a secret (issue 32).
mod audit;
// Quotas per principal: refused past one while another runs on, kept across restarts.
mod quotas;
// Live DNS rebinding: a resolver of the test's own against the proxy's checks.
mod egress_dns;
// Code mode: Python calls the operator's upstream MCP tools (issue 30).
mod codemode;
// Forged agent answers: a forged done, code left running, forged listings, links out of archives.
mod forged;
// Durable sessions: snapshots, restore, fork, hibernation, why a session ended.
mod durable;
// The result fitter under a 60 MiB result of small items (no Docker; too slow for the lib tier).
mod fit_stress;
// What a text-only client reads: failed run_file reasons, finished jobs as runs.
mod model_habits;
mod model_text; // Issue 28 items 4-7: notebook habits, wording, caches, the tool profile.
// Traces over OTLP/HTTP to a receiver of the test's, and trace context in the logs (issues 31, 32).
mod otel;
// Per-caller snapshot caps (issue 26): count and bytes, hibernated sessions included.
mod snapshot_caps;
// Both MCP generations (2026-07-28 and 2025-11-25) over stdio and HTTP, and the 2026 wire rules.
mod protocol;
// Warm pools per environment, each with its own limits (issue 29).
mod pools;
