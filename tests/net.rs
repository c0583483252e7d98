//! The guest's network with real microVMs, default deny: the guest gets `eth0` with its
//! address, route and resolver; TCP anywhere is refused at once, DNS is answered `REFUSED`,
//! other UDP and pings get nothing, and the instance stays healthy. Every packet the guest sends
//! ends at the library's gateway: nothing leaves the host (the "other" address is 192.0.2.1,
//! TEST-NET-1, which no network routes either).

mod common;
#[path = "common/guest.rs"]
mod guest;

use std::time::Duration;

use guest::sh;
use krunbox::{BuiltinImage, Network};

/// How long one guest shell script may take.
const SH_TIMEOUT: Duration = Duration::from_secs(60);

#[test]
fn the_guest_gets_eth0_with_its_address_route_and_resolver() {
    common::run(async {
        let network = Network::deny_all();
        let vm = guest::sandbox(BuiltinImage::Busybox, Some(network.clone()))
            .boot()
            .await
            .expect("boot");
        let (text, _) = sh(
            &vm,
            "ip -4 addr show dev eth0; echo ---; ip route; echo ---; cat /etc/resolv.conf; \
             echo ---; cat /sys/class/net/eth0/operstate",
            SH_TIMEOUT,
        )
        .await;
        let parts: Vec<&str> = text.split("---\n").collect();
        assert_eq!(parts.len(), 4, "{text}");
        let cidr = format!("inet {}/24", network.guest_address());
        assert!(parts[0].contains(&cidr), "address: {text}");
        let default = format!("default via {} dev eth0", network.gateway_address());
        assert!(parts[1].contains(&default), "route: {text}");
        assert_eq!(
            parts[2].trim(),
            format!("nameserver {}", network.gateway_address()),
            "resolver: {text}"
        );
        assert_eq!(parts[3].trim(), "up", "link: {text}");
        // The resolver file is not writable, even by root (a read-only bind mount).
        let (text, _) = sh(
            &vm,
            "echo nameserver 1.1.1.1 > /etc/resolv.conf; echo rc=$?",
            SH_TIMEOUT,
        )
        .await;
        assert!(!text.contains("rc=0"), "{text}");
        vm.shutdown().await.unwrap();
    });
}

#[test]
fn default_deny_refuses_tcp_and_dns_fast_and_answers_nothing_else() {
    common::run(async {
        let vm = guest::sandbox(BuiltinImage::Busybox, Some(Network::deny_all()))
            .boot()
            .await
            .expect("boot");
        // TCP to the gateway and to an address beyond it: a reset, at once.
        for target in ["10.0.2.2 80", "192.0.2.1 443"] {
            let (text, took) = sh(
                &vm,
                &format!("nc -w 10 {target} </dev/null; echo rc=$?"),
                SH_TIMEOUT,
            )
            .await;
            assert!(text.contains("Connection refused"), "{target}: {text}");
            assert!(!text.contains("rc=0"), "{target}: {text}");
            assert!(
                took < Duration::from_secs(8),
                "{target}: refused after {took:?}"
            );
        }
        // DNS through the configured resolver: REFUSED, at once.
        let (text, took) = sh(&vm, "nslookup example.com; echo rc=$?", SH_TIMEOUT).await;
        assert!(text.contains("REFUSED"), "{text}");
        assert!(!text.contains("rc=0"), "{text}");
        assert!(took < Duration::from_secs(8), "DNS refused after {took:?}");
        // DNS to another server (plain UDP elsewhere) and pings get no answer at all.
        let (text, _) = sh(
            &vm,
            "timeout 3 nslookup example.com 192.0.2.1; echo rc=$?",
            SH_TIMEOUT,
        )
        .await;
        assert!(
            !text.contains("REFUSED") && !text.contains("rc=0"),
            "{text}"
        );
        for target in ["10.0.2.2", "192.0.2.1"] {
            let (text, _) = sh(
                &vm,
                &format!("ping -c 1 -W 2 {target}; echo rc=$?"),
                SH_TIMEOUT,
            )
            .await;
            assert!(text.contains("0 packets received"), "{target}: {text}");
            assert!(text.contains("rc=1"), "{target}: {text}");
        }
        // IPv6: nothing answers, not even neighbour discovery for a link-local address (the
        // gateway drops every IPv6 frame). With no IPv6 in the guest at all, ping fails too.
        let (text, _) = sh(
            &vm,
            "ping -6 -c 1 -W 2 fe80::2%eth0; echo rc=$?",
            SH_TIMEOUT,
        )
        .await;
        assert!(!text.contains("rc=0"), "{text}");
        assert!(!text.contains(" 1 packets received"), "{text}");
        // The instance is healthy after all of it.
        assert!(vm.is_running());
        let status = vm.command("true").status().await.unwrap();
        assert!(status.success());
        vm.shutdown().await.unwrap();
    });
}

#[test]
fn a_vm_without_a_network_has_no_network_device() {
    common::run(async {
        let vm = guest::sandbox(BuiltinImage::Busybox, None)
            .boot()
            .await
            .expect("boot");
        // libkrunfw's kernel has its own virtual interfaces (lo, dummy0); none has a device.
        let (text, _) = sh(
            &vm,
            "for i in /sys/class/net/*; do [ -e $i/device ] && echo device: $i; done; \
             ls /sys/class/net",
            SH_TIMEOUT,
        )
        .await;
        assert!(!text.contains("device:"), "{text}");
        assert!(!text.contains("eth"), "{text}");
        vm.shutdown().await.unwrap();
    });
}
