#!/usr/bin/env python3
"""tests/data/topo/make-topo.py: writes the hwloc 2.x XML topologies that
tests/unit/test_bind.c loads (GPU server shapes, with PCI bridges and GPUs).

Each shape is described below the way `lstopo` would show it on the real machine: Linux
PU numbering (hyper-thread siblings in the upper half), one NUMA node per socket (or per
NPS quadrant), host bridges under the package (or NUMA group) that owns them, PCIe
switches, and GPUs as PCI devices of class 0x0302 (3D controller) with their vendor and
device ids. NICs and NVMe drives sit beside them so a test would notice the wrong device.

Run it from anywhere: it rewrites the *.xml files beside it. The output is then loaded
and re-exported by hwloc in the test's set-up check, so a file hwloc rejects fails there.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def bitmap(bits):
    """hwloc's bitmap text: 32-bit words, most significant first, "0x%08x" each."""
    bits = set(bits)
    if not bits:
        return "0x0"
    words = [0] * (max(bits) // 32 + 1)
    for b in bits:
        words[b // 32] |= 1 << (b % 32)
    return ",".join("0x%08x" % w for w in reversed(words))


class Obj:
    def __init__(self, type_, attrs=None, cpus=None, nodes=None):
        self.type, self.attrs, self.children = type_, dict(attrs or {}), []
        self.cpus, self.nodes = cpus, nodes

    def add(self, child):
        self.children.append(child)
        return child

    def xml(self, out, indent):
        pad = "  " * indent
        a = {"type": self.type}
        a.update(self.attrs)
        if self.cpus is not None:
            a["cpuset"] = a["complete_cpuset"] = bitmap(self.cpus)
            a["nodeset"] = a["complete_nodeset"] = bitmap(self.nodes)
        text = " ".join('%s="%s"' % kv for kv in a.items())
        if not self.children:
            out.append('%s<object %s/>' % (pad, text))
            return
        out.append("%s<object %s>" % (pad, text))
        for c in self.children:
            if isinstance(c, str):
                out.append(pad + "  " + c)
            else:
                c.xml(out, indent + 1)
        out.append("%s</object>" % pad)


def numa(os_index, cpus, gib):
    o = Obj("NUMANode", {"os_index": os_index, "local_memory": gib << 30}, cpus, [os_index])
    o.add('<page_type size="4096" count="%d"/>' % ((gib << 30) // 4096))
    return o


def cores(parent, first_core, n_cores, smt_offset, node, l3_cores, l3_size, l3_first):
    """Adds L3 caches of l3_cores cores each, each core with PU c and c + smt_offset."""
    l3_index = l3_first
    for base in range(first_core, first_core + n_cores, l3_cores):
        group = list(range(base, base + l3_cores))
        pus = group + ([c + smt_offset for c in group] if smt_offset else [])
        l3 = parent.add(Obj("L3Cache", {"os_index": l3_index, "cache_size": l3_size, "depth": 3,
                                         "cache_linesize": 64, "cache_associativity": 16,
                                         "cache_type": 0}, pus, [node]))
        l3_index += 1
        for c in group:
            sib = [c, c + smt_offset] if smt_offset else [c]
            core = l3.add(Obj("Core", {"os_index": c}, sib, [node]))
            for p in sib:
                core.add(Obj("PU", {"os_index": p}, [p], [node]))
    return l3_index


def pci(busid, cls, ids, rev="a1"):
    return Obj("PCIDev", {"pci_busid": busid, "pci_type": "%s %s %s" % (cls, ids[0], ids[1]) + " " + rev,
                          "pci_link_speed": "31.507692"})


def host_bridge(domain_bus_range):
    return Obj("Bridge", {"bridge_type": "0-1", "depth": 0, "bridge_pci": domain_bus_range})


def switch_port(busid, sec_range, depth):
    return Obj("Bridge", {"bridge_type": "1-1", "depth": depth, "bridge_pci": sec_range,
                          "pci_busid": busid, "pci_type": "0604 [1000:c030] [1000:a064] b0",
                          "pci_link_speed": "31.507692"})


def gpu_behind_switch(root, root_port, bus, ids, extra=()):
    """Root port -> switch upstream -> downstream port -> GPU at bus:00.0 (plus extra
    devices on sibling downstream ports, as on DGX/HGX boards)."""
    up = root.add(switch_port(root_port, "0000:[%02x-%02x]" % (bus - 2, bus + 8), 1))
    sw = up.add(switch_port("0000:%02x:00.0" % (bus - 2), "0000:[%02x-%02x]" % (bus - 1, bus + 8), 2))
    down = sw.add(switch_port("0000:%02x:00.0" % (bus - 1), "0000:[%02x-%02x]" % (bus, bus), 3))
    down.add(pci("0000:%02x:00.0" % bus, "0302", ids))
    for i, (cls, eids) in enumerate(extra):
        d = sw.add(switch_port("0000:%02x:%02x.0" % (bus - 1, i + 1),
                               "0000:[%02x-%02x]" % (bus + 1 + i, bus + 1 + i), 3))
        d.add(pci("0000:%02x:00.0" % (bus + 1 + i), cls, eids, "00"))


H100 = ("[10de:2330]", "[10de:16c1]")
T4 = ("[10de:1eb8]", "[10de:12a2]")
CX7 = ("[15b3:1021]", "[15b3:0041]")  # ConnectX-7, class 0207 (InfiniBand)
NVME = ("[144d:a80a]", "[144d:a812]")  # class 0108


def machine(sockets, extra_info):
    all_cpus = sorted({p for s in sockets for p in s.cpus})
    all_nodes = sorted({n for s in sockets for n in s.nodes})
    m = Obj("Machine", {"os_index": 0}, all_cpus, all_nodes)
    for k, v in extra_info:
        m.add('<info name="%s" value="%s"/>' % (k, v))
    for s in sockets:
        m.add(s)
    return m


def write(name, m):
    out = ['<?xml version="1.0" encoding="UTF-8"?>', '<!DOCTYPE topology SYSTEM "hwloc2.dtd">',
           '<topology version="2.0">']
    m.xml(out, 1)
    out.append("</topology>")
    with open(os.path.join(HERE, name), "w") as f:
        f.write("\n".join(out) + "\n")


def dgx_h100():
    """2 x Xeon Platinum 8480C (56 cores, HT; PUs 0-55,112-167 and 56-111,168-223), one NUMA
    node per socket, 8 x H100 SXM (class 0302), 4 per socket, each behind a PCIe switch
    shared with a ConnectX-7; bus ids as nvidia-smi shows them on a DGX H100."""
    gpus = [[0x1B, 0x43, 0x52, 0x61], [0x9D, 0xC3, 0xD1, 0xDF]]
    sockets = []
    for s in range(2):
        cpus = list(range(56 * s, 56 * s + 56)) + list(range(112 + 56 * s, 112 + 56 * s + 56))
        pkg = Obj("Package", {"os_index": s}, cpus, [s])
        pkg.add('<info name="CPUModel" value="Intel(R) Xeon(R) Platinum 8480C"/>')
        pkg.add(numa(s, cpus, 1024))
        cores(pkg, 56 * s, 56, 112, s, 56, 110100480, s)
        for i, bus in enumerate(gpus[s]):
            hb = pkg.add(host_bridge("0000:[%02x-%02x]" % (bus - 3, bus + 8)))
            gpu_behind_switch(hb, "0000:%02x:01.0" % (bus - 3), bus, H100, [("0207", CX7)])
        if s == 0:
            hb = pkg.add(host_bridge("0000:[00-02]"))
            hb.add(pci("0000:01:00.0", "0108", NVME, "00"))
        sockets.append(pkg)
    write("dgx-h100-2s8g.xml", machine(sockets, [("DMIProductName", "DGXH100")]))


def t4_server():
    """2 x Xeon Silver 4214 (12 cores, HT; PUs 0-11,24-35 and 12-23,36-47), one NUMA node
    per socket, 4 x Tesla T4 (class 0302) all on socket 0, two per root complex; socket 1
    holds only a NIC. The shape of many inference/training boxes with a 4-slot riser."""
    sockets = []
    for s in range(2):
        cpus = list(range(12 * s, 12 * s + 12)) + list(range(24 + 12 * s, 24 + 12 * s + 12))
        pkg = Obj("Package", {"os_index": s}, cpus, [s])
        pkg.add('<info name="CPUModel" value="Intel(R) Xeon(R) Silver 4214 CPU @ 2.20GHz"/>')
        pkg.add(numa(s, cpus, 192))
        cores(pkg, 12 * s, 12, 24, s, 12, 17301504, s)
        if s == 0:
            for lo, hi, buses in ((0x17, 0x3A, (0x18, 0x19)), (0x5D, 0x80, (0x5E, 0x5F))):
                hb = pkg.add(host_bridge("0000:[%02x-%02x]" % (lo, hi)))
                for j, bus in enumerate(buses):
                    rp = hb.add(switch_port("0000:%02x:%02x.0" % (lo, j), "0000:[%02x-%02x]" % (bus, bus), 1))
                    rp.add(pci("0000:%02x:00.0" % bus, "0302", T4))
        else:
            hb = pkg.add(host_bridge("0000:[85-86]"))
            hb.add(pci("0000:86:00.0", "0200", ("[8086:1572]", "[8086:0007]"), "02"))
        sockets.append(pkg)
    write("t4x4-2s.xml", machine(sockets, [("DMIProductName", "4xT4 2U server")]))


def epyc_nps4():
    """1 x EPYC 9554 (64 cores, SMT; PUs 0-63 and 64-127) in NPS4 mode: four NUMA nodes of
    16 cores, each a Group holding its NUMA node, two L3s and two GPUs (8 x H100 PCIe,
    class 0302). Here a GPU's nearest NUMA node is one of four inside one package."""
    cpus = list(range(128))
    pkg = Obj("Package", {"os_index": 0}, cpus, [0, 1, 2, 3])
    pkg.add('<info name="CPUModel" value="AMD EPYC 9554 64-Core Processor"/>')
    l3 = 0
    buses = [0x01, 0x21, 0x41, 0x61, 0x81, 0xA1, 0xC1, 0xE1]
    for q in range(4):
        qc = list(range(16 * q, 16 * q + 16)) + list(range(64 + 16 * q, 64 + 16 * q + 16))
        grp = pkg.add(Obj("Group", {"os_index": q}, qc, [q]))
        grp.add(numa(q, qc, 96))
        l3 = cores(grp, 16 * q, 16, 64, q, 8, 33554432, l3)
        for bus in buses[2 * q:2 * q + 2]:
            hb = grp.add(host_bridge("0000:[%02x-%02x]" % (bus - 1, bus + 0x1E)))
            rp = hb.add(switch_port("0000:%02x:01.1" % (bus - 1), "0000:[%02x-%02x]" % (bus, bus), 1))
            rp.add(pci("0000:%02x:00.0" % bus, "0302", ("[10de:2331]", "[10de:1626]")))
    write("epyc-nps4-8g.xml", machine([pkg], [("DMIProductName", "EPYC NPS4 8-GPU")]))


def vm_mixed():
    """A 2-socket VM (8 cores each, no SMT) whose hypervisor gives one GPU no locality (its
    host bridge hangs from the Machine, as on some clouds) and the other a socket: their
    domains nest (whole machine, socket 1)."""
    sockets = []
    for s in range(2):
        cpus = list(range(8 * s, 8 * s + 8))
        pkg = Obj("Package", {"os_index": s}, cpus, [s])
        pkg.add(numa(s, cpus, 64))
        cores(pkg, 8 * s, 8, 0, s, 8, 33554432, s)
        if s == 1:
            hb = pkg.add(host_bridge("0000:[81-81]"))
            hb.add(pci("0000:81:00.0", "0302", T4))
        sockets.append(pkg)
    m = machine(sockets, [("DMIProductName", "2-socket VM")])
    hb = m.add(host_bridge("0000:[00-00]"))
    hb.add(pci("0000:00:04.0", "0302", T4))
    write("vm-2s-nested.xml", m)


if __name__ == "__main__":
    dgx_h100()
    t4_server()
    epyc_nps4()
    vm_mixed()
    sys.exit(0)
