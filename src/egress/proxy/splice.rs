//! Copying both ways between the sandbox and its upstream under the run's byte budget, the
//! way back through the scrubber.

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::scrub::Scrubber;

/// Copies both ways until either side closes or the budget is spent; bytes each way. With
/// `one_request`, the connection ends when the upstream's answer does.
pub(super) async fn splice<C, U>(
    client: C,
    upstream: U,
    first: Vec<u8>,
    budget: &Budget,
    mut scrub: Scrubber,
    one_request: bool,
) -> (u64, u64)
where
    C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    U: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut cr, mut cw) = tokio::io::split(client);
    let (mut ur, mut uw) = tokio::io::split(upstream);
    let up_n = AtomicU64::new(0);
    let down_n = AtomicU64::new(0);
    let up = async {
        if !first.is_empty() {
            if !budget.take(first.len() as u64) || uw.write_all(&first).await.is_err() {
                return;
            }
            up_n.fetch_add(first.len() as u64, Ordering::Relaxed);
        }
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if !budget.take(n as u64) || uw.write_all(&buf[..n]).await.is_err() {
                break;
            }
            up_n.fetch_add(n as u64, Ordering::Relaxed);
        }
        let _ = uw.shutdown().await;
    };
    let down = async {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match ur.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if !budget.take(n as u64) || cw.write_all(&scrub.push(&buf[..n])).await.is_err() {
                break;
            }
            down_n.fetch_add(n as u64, Ordering::Relaxed);
        }
        let _ = cw.write_all(&scrub.finish()).await;
        let _ = cw.shutdown().await;
    };
    tokio::pin!(up, down);
    if one_request {
        tokio::select! {
            () = &mut down => {}
            () = &mut up => (&mut down).await,
        }
    } else {
        tokio::join!(up, down);
    }
    (up_n.load(Ordering::Relaxed), down_n.load(Ordering::Relaxed))
}

/// Bytes a session may still move, both ways, until the server renews it.
#[derive(Default)]
pub(super) struct Budget {
    /// Bytes left; `u64::MAX`: unbounded.
    pub(super) left: AtomicU64,
}

impl Budget {
    /// Takes `n` bytes; false once exhausted.
    pub(super) fn take(&self, n: u64) -> bool {
        let took =
            self.left
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |l| {
                    if l == u64::MAX { Some(l) } else { l.checked_sub(n) }
                })
                .is_ok();
        if !took {
            // Spent: what is left is too little for this chunk, and no later one gets through.
            self.left.store(0, Ordering::SeqCst);
        }
        took
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Budget;
    use super::*;
    use crate::egress::proxy::scrub::secret_forms;

    /// Every masked form of a secret, cut after each of its bytes: the prefix ahead of the
    /// cut held back and nothing of the secret after.
    fn cuts() -> Vec<(Vec<Vec<u8>>, Vec<u8>, usize)> {
        let forms = secret_forms("Bearer tok/en+1 2");
        let mut all = Vec::new();
        for form in &forms {
            for k in 1..form.len() {
                let mut first = b"....".to_vec();
                first.extend_from_slice(&form[..k]);
                all.push((forms.clone(), first, k));
            }
        }
        all
    }

    /// The reviewer's attack, at every cut: the upstream echoes the secret, and the run's
    /// byte budget ends between the read holding its start and the one holding the rest (or
    /// the upstream's answer just ends there). What reaches the sandbox ends masked.
    #[tokio::test]
    async fn a_secret_cut_between_two_reads_never_goes_out_in_part() {
        for (forms, first, k) in cuts() {
            for by_budget in [true, false] {
                let (client, mut sandbox) = tokio::io::duplex(1 << 16);
                let (upstream, mut echo) = tokio::io::duplex(1 << 16);
                let budget = Budget::default();
                budget.left.store(first.len() as u64, Ordering::SeqCst);
                let rest = forms.iter().find(|f| f.starts_with(&first[4..])).map(|f| f[k..].to_vec());
                let spliced =
                    async { splice(client, upstream, Vec::new(), &budget, Scrubber::new(forms.clone()), true).await };
                let upstream_side = async {
                    echo.write_all(&first).await.expect("first read");
                    // The proxy takes the first read before the rest comes.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    if by_budget {
                        let _ = echo.write_all(&rest.unwrap_or_default()).await;
                    }
                    drop(echo);
                    let mut got = Vec::new();
                    sandbox.read_to_end(&mut got).await.expect("read");
                    got
                };
                let (_, got) = tokio::join!(spliced, upstream_side);
                let want = format!("....{}", "*".repeat(k));
                assert_eq!(
                    String::from_utf8_lossy(&got),
                    want,
                    "cut after {k} bytes of a form, by budget: {by_budget}"
                );
            }
        }
    }
}
