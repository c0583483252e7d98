//! `krunbox run --stats`: what the VM cost the host, as text or JSON.

/// `--stats`: how metrics are printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum StatsFormat {
    Text,
    Json,
}

/// The `--stats` report.
pub(crate) fn stats_text(metrics: &krunbox::Metrics, format: StatsFormat) -> String {
    if format == StatsFormat::Json {
        return serde_json::to_string(metrics)
            .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    }
    let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
    let mut text = format!(
        "krunbox stats: cpu {:.2} s, memory {:.1} MiB (peak {:.1} MiB)",
        metrics.cpu_time.as_secs_f64(),
        mib(metrics.memory_bytes),
        mib(metrics.memory_peak_bytes),
    );
    if let (Some(read), Some(written)) = (metrics.disk_read_bytes, metrics.disk_written_bytes) {
        text += &format!(
            ", disk read {:.1} MiB, written {:.1} MiB",
            mib(read),
            mib(written)
        );
    }
    if let Some(net) = &metrics.network {
        text += &format!(
            ", network {:.1} MiB out, {:.1} MiB in, {} flows granted, {} denied",
            mib(net.bytes_from_guest),
            mib(net.bytes_to_guest),
            net.flows_granted,
            net.flows_denied,
        );
    }
    if let Some(root) = &metrics.root {
        text += &format!(
            ", root {:.1} of {:.1} MiB",
            mib(root.held_bytes),
            mib(root.max_bytes)
        );
    }
    text += &format!(
        ", host work before the VM {:.1} ms",
        metrics.host_boot_work.as_secs_f64() * 1000.0
    );
    text
}
