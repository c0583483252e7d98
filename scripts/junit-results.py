#!/usr/bin/env python3
"""junit-results.py FILE SIGNATURE: one line per test case in cargo-nextest's JUnit report,
tab-separated: STATUS (pass, fail or skip), the binary id, the test's name, and FAULT: 1 when a
failure's output matches the regular expression SIGNATURE (the diagnosed signatures of a fault of
the nested hypervisor, from scripts/test.sh; docs/testing.md), else 0. scripts/test.sh decides
retries from it."""
import re
import sys
import xml.etree.ElementTree as ET

FAULT = re.compile(sys.argv[2])

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
