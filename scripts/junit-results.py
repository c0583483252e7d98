#!/usr/bin/env python3
"""junit-results.py FILE: one line per test case in cargo-nextest's JUnit report, tab-separated:
STATUS (pass, fail or skip), the binary id, the test's name, and FAULT: 1 when a failure's
output carries the diagnosed signature of a fault of the nested hypervisor (docs/testing.md),
else 0. scripts/test.sh decides retries from it."""
import re
import sys
import xml.etree.ElementTree as ET

# What scripts/nested.sh exec and the library print for faults of the emulation underneath:
# L1 itself died, KVM in L1 looped on one guest instruction, or the guest CPU triple-faulted.
FAULT = re.compile(r"krunbox-nested-l1-died|krunbox-nested-emulation-fault|KVM_EXIT_SHUTDOWN")

for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    binary, name = case.get("classname", ""), case.get("name", "")
    failure = case.find("failure")
    if failure is None:
        failure = case.find("error")
    if failure is not None:
        text = " ".join(
            (e.text or "") + " " + " ".join(f"{k}={v}" for k, v in e.attrib.items())
            for e in case.iter()
        )
        status, fault = "fail", int(bool(FAULT.search(text)))
    elif case.find("skipped") is not None:
        status, fault = "skip", 0
    else:
        status, fault = "pass", 0
    print(f"{status}\t{binary}\t{name}\t{fault}")
