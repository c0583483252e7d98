#!/usr/bin/env python3
"""junit-results.py FILE SIGNATURE: one line per test case in cargo-nextest's JUnit report,
tab-separated: STATUS (pass, fail or skip), the binary id, the test's name, and FAULT: 1 when a
failure's output matches the regular expression SIGNATURE (the diagnosed signatures of a fault of
the nested hypervisor, from scripts/test.sh; docs/testing.md), else 0, and WHY: for a failure,
its panic message (or its output's last lines) on one line, at most 600 characters, else empty.
scripts/test.sh decides retries from it and prints each failure's WHY in its summary, the part of
its output that a reader of CI's log sees first."""
import re
import sys
import xml.etree.ElementTree as ET

FAULT = re.compile(sys.argv[2])
PANIC = re.compile(r"panicked at |^Error: |krunbox-nested-")


def why(case):
    """The lines that say why a failed test failed: from its first panic (or fault marker) on,
    else its output's last lines; one line, bounded."""
    lines = []
    for tag in ("system-out", "system-err"):
        for e in case.iter(tag):
            lines += [line.strip() for line in (e.text or "").splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if PANIC.search(line)), None)
    picked = lines[start : start + 4] if start is not None else lines[-4:]
    text = " | ".join(line[:300] for line in picked).replace("\t", " ")
    return text[:600]


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
        status, fault, reason = "fail", int(bool(FAULT.search(text))), why(case)
    elif case.find("skipped") is not None:
        status, fault, reason = "skip", 0, ""
    else:
        status, fault, reason = "pass", 0, ""
    print(f"{status}\t{binary}\t{name}\t{fault}\t{reason}")
