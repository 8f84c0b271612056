"""llamax.usable_cores(): the affinity mask cut to the cgroup CPU quota.

The cgroup layouts are real file trees (a ``/proc/self`` and a cgroup mount
under a temporary root), as the kernel writes them for a host, a v1 and a v2
container; one test puts a real process into a real v1 cgroup with a quota
where this machine lets it (root, a writable cpu hierarchy)."""
import os
import uuid

import pytest

from conftest import run_py
from llamax import _cpus
from llamax._cpus import cgroup_cpu_limit, usable_cores

V1_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 {root} /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V2_MOUNTS = "30 23 0:27 {root} /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def _tree(tmp_path, cgroup, mountinfo, files):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    (tmp_path / "proc/self/mountinfo").write_text(mountinfo)
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(tmp_path)


def test_v2_quota_of_own_cgroup(tmp_path):
    root = _tree(tmp_path, "0::/kubepods/pod1/c1\n", V2_MOUNTS.format(root="/"), {
        "sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "150000 100000\n",
        "sys/fs/cgroup/kubepods/pod1/cpu.max": "max 100000\n",
        "sys/fs/cgroup/kubepods/cpu.max": "max 100000\n",
    })
    assert cgroup_cpu_limit(root) == pytest.approx(1.5)


def test_v2_tightest_ancestor_wins(tmp_path):
    root = _tree(tmp_path, "0::/a/b/c\n", V2_MOUNTS.format(root="/"), {
        "sys/fs/cgroup/a/b/c/cpu.max": "400000 100000\n",
        "sys/fs/cgroup/a/b/cpu.max": "max 100000\n",
        "sys/fs/cgroup/a/cpu.max": "50000 50000\n",  # 1 CPU: the parent caps the child
    })
    assert cgroup_cpu_limit(root) == pytest.approx(1.0)


def test_v2_no_quota(tmp_path):
    root = _tree(tmp_path, "0::/user.slice\n", V2_MOUNTS.format(root="/"), {
        "sys/fs/cgroup/user.slice/cpu.max": "max 100000\n",
    })
    assert cgroup_cpu_limit(root) is None


def test_v2_container_root_is_its_own_cgroup(tmp_path):
    # docker with a cgroup namespace: the mount shows the container's cgroup
    # as "/", and /proc/self/cgroup says "0::/"
    root = _tree(tmp_path, "0::/\n", V2_MOUNTS.format(root="/"), {
        "sys/fs/cgroup/cpu.max": "200000 100000\n",
    })
    assert cgroup_cpu_limit(root) == pytest.approx(2.0)


@pytest.mark.parametrize("own", ["/../../system.slice/docker-1.scope", "/docker/other"])
def test_v2_path_outside_the_mount_reads_the_mount_point(tmp_path, own):
    # without a cgroup namespace, or a path the mount does not show: the
    # mount point is the nearest cgroup this process can read
    root = _tree(tmp_path, f"0::{own}\n", V2_MOUNTS.format(root="/docker/abc"), {
        "sys/fs/cgroup/cpu.max": "300000 100000\n",
    })
    assert cgroup_cpu_limit(root) == pytest.approx(3.0)


def test_v2_mount_root_below_the_hierarchy_root(tmp_path):
    # the mount shows the hierarchy from /kubepods down: /kubepods/pod1 is at <mount>/pod1
    root = _tree(tmp_path, "0::/kubepods/pod1\n", V2_MOUNTS.format(root="/kubepods"), {
        "sys/fs/cgroup/pod1/cpu.max": "250000 100000\n",
    })
    assert cgroup_cpu_limit(root) == pytest.approx(2.5)


def test_v1_cpu_controller(tmp_path):
    root = _tree(tmp_path, "12:memory:/docker/x\n4:cpu,cpuacct:/docker/x\n0::/\n", V1_MOUNTS.format(root="/"), {
        "sys/fs/cgroup/cpu,cpuacct/docker/x/cpu.cfs_quota_us": "50000\n",
        "sys/fs/cgroup/cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n",
        "sys/fs/cgroup/cpu,cpuacct/docker/cpu.cfs_quota_us": "-1\n",
        "sys/fs/cgroup/cpu,cpuacct/docker/cpu.cfs_period_us": "100000\n",
    })
    assert cgroup_cpu_limit(root) == pytest.approx(0.5)


def test_v1_unlimited(tmp_path):
    root = _tree(tmp_path, "4:cpu,cpuacct:/\n", V1_MOUNTS.format(root="/"), {
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })
    assert cgroup_cpu_limit(root) is None


def test_mountinfo_escapes(tmp_path):
    # a mount point with a space is written "\040" in mountinfo
    mounts = "30 23 0:27 / /sys/fs/my\\040cgroup rw - cgroup2 cgroup2 rw\n"
    root = _tree(tmp_path, "0::/\n", mounts, {"sys/fs/my cgroup/cpu.max": "100000 100000\n"})
    assert cgroup_cpu_limit(root) == pytest.approx(1.0)


@pytest.mark.parametrize("text", ["", "garbage\n", "abc 100000\n", "0 100000\n", "100000 0\n", "-5 100000\n"])
def test_unreadable_or_nonsense_quota_limits_nothing(tmp_path, text):
    root = _tree(tmp_path, "0::/\n", V2_MOUNTS.format(root="/"), {"sys/fs/cgroup/cpu.max": text})
    assert cgroup_cpu_limit(root) is None


def test_missing_proc_files_limit_nothing(tmp_path):
    assert cgroup_cpu_limit(str(tmp_path)) is None
    root = _tree(tmp_path, "garbage without colons\n", "not a mountinfo line\n", {})
    assert cgroup_cpu_limit(root) is None


def test_usable_cores_on_this_machine():
    # whatever this machine is: at least 1, at most the affinity mask, and
    # no more than the quota rounded up
    n = usable_cores()
    assert 1 <= n <= len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit()
    if limit is not None:
        assert n <= max(1, -(-limit // 1))


def _v1_cpu_hierarchy():
    """This machine's mounted v1 cpu hierarchy, if root may make a cgroup there."""
    with open("/proc/self/mountinfo") as f:
        mounts = f.read()
    for _, point, fstype, options in _cpus._mounts(mounts):
        if fstype == "cgroup" and "cpu" in options and os.access(point, os.W_OK):
            return point
    return None


def test_a_real_cgroup_quota_cuts_a_real_llama(smollm2_path):
    """A process moved into a cgroup with half a CPU of quota: usable_cores()
    says 1, and a Llama there runs one thread by default, and one when asked
    for 8 (with the warning).  Runs where this machine has a writable v1 cpu
    hierarchy (root on these VMs); elsewhere the file trees above cover it."""
    point = _v1_cpu_hierarchy()
    if point is None:
        pytest.skip("no writable cgroup v1 cpu hierarchy here (needs root)")
    group = os.path.join(point, f"llamax-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(group)
    try:
        with open(os.path.join(group, "cpu.cfs_period_us"), "w") as f:
            f.write("100000")
        with open(os.path.join(group, "cpu.cfs_quota_us"), "w") as f:
            f.write("50000")
        code = f"""
import os, warnings
with open({os.path.join(group, "tasks")!r}, "w") as f:
    f.write(str(os.getpid()))
import llamax
print("CORES", llamax.usable_cores())
llm = llamax.Llama({str(smollm2_path)!r}, n_ctx=256, verbose=False)
print("DEFAULT", llm._pool.slots[0].ctx.n_threads)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    llm8 = llamax.Llama({str(smollm2_path)!r}, n_ctx=256, n_threads=8, verbose=False)
print("ASKED8", llm8._pool.slots[0].ctx.n_threads, llm8._pool.slots[0].ctx.n_threads_batch)
print("WARN", [str(x.message) for x in w if x.category is llamax.OversubscriptionWarning])
print("TEXT", llm8("The sky is", max_tokens=3, temperature=0.0)["choices"][0]["text"] != None)
"""
        r = run_py(code, env={"LLAMAX_OVERSUBSCRIBE": ""})
        assert r.returncode == 0, r.stderr[-3000:]
        lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
        assert lines["CORES"] == "1"
        assert lines["DEFAULT"] == "1"
        assert lines["ASKED8"] == "1 1"
        assert "n_threads=8" in lines["WARN"] and "1 core" in lines["WARN"]
        assert lines["TEXT"] == "True"
    finally:
        os.rmdir(group)
