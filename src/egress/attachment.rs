//! A session's place on its egress network: its proxy variables, its CA bundle, and how its
//! container joins the network.

use super::*;

/// What a session container needs for egress: its network and the proxy's address there.
#[derive(Clone)]
pub struct Attachment {
    /// The session's own `internal` network.
    pub network: String,
    /// The proxy's address on it.
    pub proxy_ip: IpAddr,
    /// The CA bundle to trust: the server's `--ca-bundle` and the per-server CA.
    pub ca: Option<Arc<Vec<u8>>>,
    /// True when the server has no bundle: the image's own CAs go first in the session's.
    pub system_roots: bool,
    /// The allow-list in force (narrowed by `set_network`), for the session's record: a
    /// restarted server that adopts the session puts exactly this back.
    pub rules: Arc<Mutex<Vec<String>>>,
    /// Sessions keyed by their own address (Kubernetes): puts the policy in after start.
    pub binder: Option<Arc<super::Binder>>,
    /// Keyed by peer: the session's pass, in its proxy URL (`pyberth:<pass>@`).
    pub pass: Option<Arc<str>>,
}

/// Without the pass (which its `Debug` would show, and a log would keep).
impl std::fmt::Debug for Attachment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attachment")
            .field("network", &self.network)
            .field("proxy_ip", &self.proxy_ip)
            .field("rules", &self.rules)
            .finish_non_exhaustive()
    }
}

impl Attachment {
    /// The allow-list in force now.
    pub fn allow(&self) -> Vec<String> {
        self.rules.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Attachment {
    /// The proxy variables, and the CA bundle's, for every library that reads them.
    pub fn env(&self) -> Vec<String> {
        let user = self.pass.as_ref().map(|p| format!("pyberth:{p}@")).unwrap_or_default();
        let url = match self.proxy_ip {
            IpAddr::V6(ip) => format!("http://{user}[{ip}]:{}", proxy::PORT),
            ip => format!("http://{user}{ip}:{}", proxy::PORT),
        };
        let mut env: Vec<String> =
            ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"].iter().map(|k| format!("{k}={url}")).collect();
        // Empty: everything goes through the proxy (nothing else is reachable anyway).
        env.extend(["NO_PROXY=".to_owned(), "no_proxy=".to_owned()]);
        if self.ca.is_some() {
            for k in ["SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO"] {
                env.push(format!("{k}={CA_PATH}"));
            }
        }
        env
    }

    /// How a session container joins its network instead of none: DNS points at the proxy's
    /// resolver, and the proxy and CA variables are set.
    pub fn join(&self) -> crate::docker::container::NetworkJoin {
        crate::docker::container::NetworkJoin {
            network: self.network.clone(),
            dns: vec![self.proxy_ip.to_string()],
            env: self.env(),
        }
    }

    /// Only the proxy variables (no CA paths: a container that gets no CA bundle written).
    pub fn proxy_env(&self) -> Vec<String> {
        self.env().into_iter().filter(|e| e.to_ascii_lowercase().contains("proxy=")).collect()
    }

    /// Before the session's container is removed, or once it is found gone: a session keyed
    /// by its own address (Kubernetes) has its policy taken out of the proxy, as the address
    /// may be the next pod's. Nothing for a session with a network of its own (Docker).
    pub async fn unbind(&self) {
        if let Some(b) = &self.binder {
            b.unbind().await;
        }
    }

    /// After the container starts, before any code runs: the CA bundle into
    /// [`CA_PATH`] on the container's own `/tmp`, written by root (no capabilities) through
    /// a short exec. Root's file in a root-owned directory under the sticky `/tmp`: the code
    /// reads it and can neither replace nor remove it. (The root filesystem is read-only and
    /// the engine cannot copy into a tmpfs, hence an exec.)
    pub async fn after_start(&self, docker: &dyn Engine, id: &str) -> Result<(), bollard::errors::Error> {
        use bollard::exec::{CreateExecOptions, StartExecResults};
        use futures::StreamExt;
        use tokio::io::AsyncWriteExt;
        if let Some(b) = &self.binder {
            b.bind(docker, id).await.map_err(|e| bollard::errors::Error::IOError { err: std::io::Error::other(e) })?;
        }
        let Some(ca) = &self.ca else { return Ok(()) };
        let script = format!(
            "umask 022 && mkdir -p {dir} && {{ {system} cat; }} > {dir}/.ca.tmp && chmod 0444 {dir}/.ca.tmp && mv {dir}/.ca.tmp {CA_PATH}",
            dir = CA_DIR,
            system = if self.system_roots { "cat /etc/ssl/certs/ca-certificates.crt 2>/dev/null;" } else { "" }
        );
        let opts = CreateExecOptions {
            attach_stdin: Some(true),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            user: Some("0".to_owned()),
            cmd: Some(vec!["sh".to_owned(), "-c".to_owned(), script]),
            ..Default::default()
        };
        let exec = docker.create_exec(id, opts.into()).await?;
        if let StartExecResults::Attached { mut input, mut output } = docker.start_exec(&exec.id, None).await? {
            let io = |err| bollard::errors::Error::IOError { err };
            input.write_all(ca).await.map_err(io)?;
            input.shutdown().await.map_err(io)?;
            drop(input);
            while let Some(frame) = output.next().await {
                frame?;
            }
        }
        match docker.inspect_exec(&exec.id).await?.exit_code {
            Some(0) => Ok(()),
            code => Err(bollard::errors::Error::IOError {
                err: std::io::Error::other(format!("writing the CA bundle into the session failed (exit {code:?})")),
            }),
        }
    }
}

pub(super) fn tar_one(name: &str, data: &[u8], mode: u32) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(data.len() as u64);
    h.set_mode(mode);
    h.set_uid(0);
    h.set_gid(0);
    h.set_cksum();
    // Writing into a Vec cannot fail.
    let _ = b.append_data(&mut h, name, data);
    b.into_inner().unwrap_or_default()
}
