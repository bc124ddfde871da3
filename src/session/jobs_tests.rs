//! Unit tests of the jobs table (`jobs.rs`): pruning and per-principal bounds.

use super::*;

fn finished(id: &str, principal: &str) -> Arc<Job> {
    let job = Job::new(id.to_owned(), principal, "s", Instant::now(), 0, None);
    job.finish(Finished::Failed("x".into()));
    Arc::new(job)
}

fn with_images(id: &str, principal: &str, images: usize) -> Arc<Job> {
    let job = finished(id, principal);
    let mut outcome = RunOutcome::new(0);
    outcome.images = (0..images).map(|_| ("image/png".to_owned(), "QUJD".repeat(1 << 18))).collect();
    job.finish(Finished::Outcome(Box::new(outcome)));
    job
}

fn images_of(job: &Job) -> usize {
    match job.result().as_deref() {
        Some(Finished::Outcome(o)) => o.images.len(),
        _ => 0,
    }
}

#[test]
fn finished_jobs_keep_images_within_a_budget_per_principal_newest_first() {
    let jobs = Jobs::default();
    {
        let mut map = jobs.jobs.lock().expect("jobs");
        map.insert("alice-1".into(), with_images("alice-1", "alice", 8));
        for i in 0..10 {
            let id = format!("mallory-{i}");
            map.insert(id.clone(), with_images(&id, "mallory", 8)); // 8 MiB each
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    jobs.prune();
    assert_eq!(images_of(&jobs.get("alice", "alice-1").expect("alice's job")), 8, "another caller's flood");
    let kept: Vec<usize> =
        (0..10).map(|i| images_of(&jobs.get("mallory", &format!("mallory-{i}")).expect("job"))).collect();
    assert_eq!(kept, [0, 0, 0, 0, 0, 0, 8, 8, 8, 8], "the newest 32 MiB");
    let result = jobs.get("mallory", "mallory-0").and_then(|j| j.result());
    let Some(Finished::Outcome(o)) = result.as_deref() else { panic!("an outcome") };
    assert!(o.notices.iter().any(|n| n.contains("8 images were dropped from the kept result")), "{:?}", o.notices);
}

#[test]
fn one_principal_s_many_jobs_never_evict_another_s_results() {
    let jobs = Jobs::default();
    {
        let mut map = jobs.jobs.lock().expect("jobs");
        map.insert("alice-1".into(), finished("alice-1", "alice"));
        for i in 0..MAX_FINISHED + 6 {
            let id = format!("mallory-{i}");
            map.insert(id.clone(), finished(&id, "mallory"));
        }
    }
    jobs.prune();
    assert!(jobs.get("alice", "alice-1").is_some(), "alice's result survives mallory's flood");
    assert_eq!(jobs.list("mallory").len(), MAX_FINISHED, "mallory keeps only the newest");
}

/// A job that ends while nobody waits on it still reads as finished (`list_jobs`' filter):
/// `watch::Sender::send` stores nothing without a receiver.
#[test]
fn a_job_finished_with_nobody_waiting_reads_as_finished() {
    let job = finished("job-1", "alice");
    assert!(job.is_finished());
    let jobs = Jobs::default();
    jobs.jobs.lock().expect("jobs").insert(job.id.clone(), job);
    assert!(jobs.list("alice").iter().all(|j| j.is_finished()));
}

/// Listing many jobs never panics: the order is by start, not by an elapsed time that moves
/// while the sort compares.
#[test]
fn listing_many_jobs_sorts_by_a_key_that_holds_still() {
    let jobs = Jobs::default();
    {
        let mut map = jobs.jobs.lock().expect("jobs");
        for i in 0..2000 {
            let id = format!("job-{i}");
            map.insert(id.clone(), finished(&id, "alice"));
        }
    }
    for _ in 0..20 {
        let list = jobs.list("alice");
        assert!(list.windows(2).all(|w| w[0].started <= w[1].started), "oldest first");
    }
}

/// A closed session's jobs lose their records (a session of that name made later is another
/// one), and a job of it that ends afterwards does not write its record back.
#[test]
fn a_closed_session_s_job_records_go_and_stay_gone() {
    use crate::durable::jobs::{Files, Record, read_left};
    let dir = std::env::temp_dir().join(format!("pyberth-jobs-forget-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let job = |id: &str, session: &str| {
        let record = Record::new(id, "inst-a", "alice", session, "c", Duration::from_secs(60), 1024);
        let files = Files::open(&dir, record, true).expect("files");
        Arc::new(Job::new(id.to_owned(), "alice", session, Instant::now(), 1024, Some(files)))
    };
    let (closed, other) = (job("job-1", "s"), job("job-2", "t"));
    let at = Instant::now();
    // A new session of the closed one's name, whose job started after it was closed.
    let successor = job("job-3", "s");
    let jobs = Jobs::default();
    for j in [closed.clone(), other, successor] {
        jobs.jobs.lock().expect("jobs").insert(j.id.clone(), j);
    }
    jobs.forget_session("alice", "s", at);
    let ids = || {
        let mut v: Vec<String> = read_left(&dir, "inst-a").into_iter().map(|l| l.record.id).collect();
        v.sort();
        v
    };
    assert_eq!(ids(), ["job-2", "job-3"], "the other session's and the successor's jobs are recorded");
    closed.finish(Finished::Failed("ended with its session".into()));
    assert_eq!(ids(), ["job-2", "job-3"], "the closed session's job did not write its record back");
    let _ = std::fs::remove_dir_all(&dir);
}
