//! Logs of concurrent sandboxes can be told apart: every `tracing` event of an instance is in
//! its `instance` span (with its id), and those of a process, a file operation or a network
//! flow in a span of their own below it.

mod common;
#[path = "common/http_origin.rs"]
mod http_origin;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use krunbox::net::{Flow, Network, Protocol, Resolver, Verdict};
use krunbox::{BuiltinImage, Instance, Rootfs, Sandbox};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;
use tracing_subscriber::registry::LookupSpan;

/// One event as captured: its target, its fields, and the spans it was in (innermost first),
/// each with its fields.
#[derive(Debug, Clone)]
struct Captured {
    target: String,
    fields: HashMap<String, String>,
    spans: Vec<(String, HashMap<String, String>)>,
}

impl Captured {
    fn span(&self, name: &str) -> Option<&HashMap<String, String>> {
        self.spans.iter().find(|(n, _)| n == name).map(|(_, f)| f)
    }
}

#[derive(Default)]
struct Fields(HashMap<String, String>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(
            field.name().to_owned(),
            format!("{value:?}").trim_matches('"').to_owned(),
        );
    }
}

/// Keeps every krunbox event with its span scope.
struct Capture(Arc<Mutex<Vec<Captured>>>);

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(fields);
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        if !event.metadata().target().starts_with("krunbox") {
            return;
        }
        let mut fields = Fields::default();
        event.record(&mut fields);
        let spans = ctx
            .event_scope(event)
            .map(|scope| {
                scope
                    .map(|span| {
                        let fields = span
                            .extensions()
                            .get::<Fields>()
                            .map(|f| f.0.clone())
                            .unwrap_or_default();
                        (span.name().to_owned(), fields)
                    })
                    .collect()
            })
            .unwrap_or_default();
        self.0.lock().unwrap().push(Captured {
            target: event.metadata().target().to_owned(),
            fields: fields.0,
            spans,
        });
    }
}

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

async fn sandbox_for(port: u16) -> Instance {
    let network = Network::with_policy(move |flow: Flow| async move {
        match (flow.protocol(), flow.hostname()) {
            (Protocol::Dns, Some("origin.test")) => Verdict::resolve(Resolver::fixed([LOOPBACK])),
            (Protocol::Tcp, Some("origin.test")) if flow.destination().port() == port => {
                Verdict::accept()
            }
            _ => Verdict::deny(),
        }
    });
    Sandbox::builder()
        .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
        .memory_mib(256)
        .network(network)
        .build()
        .expect("definition")
        .boot()
        .await
        .expect("boot")
}

/// Two sandboxes work at once: a process, a file read and a granted connection each. Every
/// event of theirs is in its instance's span, with that instance's id; each flow's decision is
/// in a `flow` span of the instance whose guest started it; a process's start in an `exec`
/// span, a file request in a `file` span.
#[test]
fn every_event_names_its_instance_and_what_it_was_doing() {
    let captured = Arc::new(Mutex::new(Vec::new()));
    tracing_subscriber::registry()
        .with(Capture(captured.clone()).with_filter(tracing_subscriber::filter::LevelFilter::TRACE))
        .init();
    common::run(async {
        let (port_a, _) = http_origin::start().await;
        let (port_b, _) = http_origin::start().await;
        let (a, b) = tokio::join!(sandbox_for(port_a), sandbox_for(port_b));
        assert_ne!(a.id(), b.id());
        let work = |vm: &Instance, port: u16| {
            let script = format!("wget -q -O - http://origin.test:{port}/x; cat /etc/hostname");
            let vm = vm.clone();
            async move {
                let out = vm
                    .command("sh")
                    .args(["-c", &script])
                    .timeout(Duration::from_secs(60))
                    .output()
                    .await
                    .unwrap();
                assert!(out.stdout_text().contains("origin says /x"), "{out:?}");
                vm.read_file("/etc/passwd").await.unwrap();
            }
        };
        tokio::join!(work(&a, port_a), work(&b, port_b));
        let ids = [a.id().to_owned(), b.id().to_owned()];
        let events = captured.lock().unwrap().clone();
        let instance_of = |e: &Captured| e.span("instance").and_then(|f| f.get("id")).cloned();
        // The network's decisions: each in a flow span of the instance whose guest asked.
        let decisions: Vec<&Captured> = events
            .iter()
            .filter(|e| e.fields.get("message").map(String::as_str) == Some("network flow"))
            .collect();
        assert!(
            decisions.len() >= 4,
            "two DNS queries and two connections: {decisions:#?}"
        );
        for decision in &decisions {
            let flow = decision.fields.get("flow").cloned().unwrap_or_default();
            assert!(decision.span("flow").is_some(), "{decision:?}");
            let id = instance_of(decision).unwrap_or_else(|| panic!("no instance: {decision:?}"));
            if flow.contains(&format!(":{port_a}")) {
                assert_eq!(id, ids[0], "{decision:?}");
            } else if flow.contains(&format!(":{port_b}")) {
                assert_eq!(id, ids[1], "{decision:?}");
            }
        }
        for (name, message) in [("exec", "process started"), ("file", "file request sent")] {
            let of_kind: Vec<&Captured> = events
                .iter()
                .filter(|e| e.fields.get("message").map(String::as_str) == Some(message))
                .collect();
            assert!(of_kind.len() >= 2, "{name}: {of_kind:#?}");
            for event in of_kind {
                assert!(event.span(name).is_some(), "{event:?}");
                assert!(ids.contains(&instance_of(event).unwrap()), "{event:?}");
            }
        }
        // Nothing of the network, the mounts' serving or the control channel outside an
        // instance's span.
        for event in &events {
            if ["krunbox::net", "krunbox::fs"]
                .iter()
                .any(|t| event.target.starts_with(t))
            {
                let id = instance_of(event).unwrap_or_else(|| panic!("no instance: {event:?}"));
                assert!(ids.contains(&id), "{event:?}");
            }
        }
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    });
}
