"""Replica placement (group/ring, failure domains), survival odds, the peer list, and ``ckpt placement``."""

from __future__ import annotations

import argparse
import itertools
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from procs import env

from agents import placement
from agents.placement import (
    Node,
    PeerListError,
    holders,
    losing_failure,
    parse_peers,
    placement_order,
    replica_targets,
    survival_probability,
    survives,
    survives_all,
)
from ckpt._placement_cli import add_parser


def _targets(n, k, how="group"):
    return {r: copies[1:] for r, copies in holders(n, k, how).items()}


def _nodes(domains):
    return [Node(i, f"node{i}:7070", d) for i, d in enumerate(domains)]


def _brute_alive(nodes, k, how, f):
    """Failure sets of size f that lose nothing, by asking ``survives`` about each one."""
    ranks = [x.rank for x in nodes] if not isinstance(nodes, int) else list(range(nodes))
    return sum(survives(nodes, k, how, set(c)) for c in itertools.combinations(ranks, f))


# -- where copies go -------------------------------------------------------------------------

def test_group_placement_replicates_inside_groups_of_k():
    assert _targets(4, 2) == {0: [1], 1: [0], 2: [3], 3: [2]}
    assert _targets(6, 3) == {0: [1, 2], 1: [2, 0], 2: [0, 1], 3: [4, 5], 4: [5, 3], 5: [3, 4]}


def test_ring_placement_replicates_to_the_next_k_minus_1_nodes():
    assert _targets(4, 2, "ring") == {0: [1], 1: [2], 2: [3], 3: [0]}
    assert _targets(5, 3, "ring") == {0: [1, 2], 1: [2, 3], 2: [3, 4], 3: [4, 0], 4: [0, 1]}


def test_group_placement_with_a_remainder_puts_the_last_k_plus_r_nodes_in_a_ring():
    # GEMINI's mixed strategy: N // k - 1 groups, then a ring of k + N % k nodes
    assert _targets(5, 2) == {0: [1], 1: [0], 2: [3], 3: [4], 4: [2]}
    assert _targets(7, 3) == {0: [1, 2], 1: [2, 0], 2: [0, 1], 3: [4, 5], 4: [5, 6], 5: [6, 3], 6: [3, 4]}
    assert _targets(3, 2) == {0: [1], 1: [2], 2: [0]}


def test_fewer_nodes_than_replicas_copies_to_every_other_node():
    assert _targets(2, 4) == {0: [1], 1: [0]}
    assert _targets(3, 5, "ring") == {0: [1, 2], 1: [2, 0], 2: [0, 1]}
    assert _targets(1, 2) == {0: []}


def test_one_replica_means_no_peer_copies():
    assert _targets(3, 1) == {0: [], 1: [], 2: []}


def test_replica_targets_agrees_with_holders_and_rejects_bad_arguments():
    nodes = _nodes([None] * 5)
    for r in range(5):
        assert replica_targets(nodes, r, 2) == holders(nodes, 2)[r][1:]
    with pytest.raises(ValueError, match="not in the peer list"):
        replica_targets(nodes, 7, 2)
    with pytest.raises(ValueError, match="replicas"):
        replica_targets(nodes, 0, 0)
    with pytest.raises(ValueError, match="unknown placement"):
        replica_targets(nodes, 0, 2, "random")
    with pytest.raises(ValueError, match="share a rank"):
        replica_targets([Node(0, "a:1"), Node(0, "b:1")], 0, 2)


def test_placement_does_not_depend_on_the_order_nodes_are_given_in():
    nodes = _nodes(["a", "a", "b", "b", "c"])
    assert holders(nodes[::-1], 2) == holders(nodes, 2)


# -- failure domains -------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["group", "ring"])
def test_copies_go_to_the_other_domain_when_racks_hold_consecutive_ranks(how):
    nodes = _nodes(["a", "a", "b", "b"])
    dom = {x.rank: x.domain for x in nodes}
    for r, copies in holders(nodes, 2, how).items():
        assert len(copies) == 2
        assert dom[copies[1]] != dom[r]


def test_domains_keep_group_placement_in_closed_groups_across_racks():
    nodes = _nodes(["a", "a", "b", "b", "c", "c"])
    assert placement_order(nodes) == [0, 2, 4, 1, 3, 5]
    h = holders(nodes, 3)
    assert {frozenset(c) for c in h.values()} == {frozenset({0, 2, 4}), frozenset({1, 3, 5})}
    result = survival_probability(nodes, 3, 3)
    assert "closed form" in result.method
    assert result.probability == _brute_alive(nodes, 3, "group", 3) / math.comb(6, 3)


def test_all_nodes_in_one_domain_still_get_k_minus_1_copies():
    nodes = _nodes(["rack"] * 5)
    assert holders(nodes, 3) == holders(5, 3)
    assert holders(nodes, 3, "ring") == holders(5, 3, "ring")


def test_copy_moves_to_the_nearest_node_of_an_unused_domain_when_interleaving_is_not_enough():
    # interleaved order 0(a) 4(b) 6(c) 1(a) 5(b) 7(c) 2(a) 3(a): the last group {2, 3} is one rack
    nodes = _nodes(["a", "a", "a", "a", "b", "b", "c", "c"])
    t = _targets(nodes, 2)
    assert t[2] == [4] and t[3] == [4]
    assert t[0] == [4] and t[4] == [0]


def test_nodes_without_a_domain_are_each_a_domain_of_their_own():
    assert holders(_nodes([None] * 6), 2) == holders(6, 2)
    assert placement_order(_nodes(["a", "a", None, None])) == [0, 2, 3, 1]


# -- properties ------------------------------------------------------------------------------

DOMAINS = st.lists(st.sampled_from([None, "a", "b", "c"]), min_size=1, max_size=9)
PLACEMENT = st.sampled_from(["group", "ring"])


@settings(max_examples=300, deadline=None)
@given(domains=DOMAINS, k=st.integers(1, 4), how=PLACEMENT)
def test_every_node_gets_min_k_minus_1_n_minus_1_distinct_targets_never_itself(domains, k, how):
    nodes = _nodes(domains)
    n = len(nodes)
    for r in range(n):
        t = replica_targets(nodes, r, k, how)
        assert len(t) == len(set(t)) == min(k - 1, n - 1)
        assert r not in t and set(t) <= set(range(n))


@settings(max_examples=300, deadline=None)
@given(domains=DOMAINS, k=st.integers(1, 4), how=PLACEMENT)
def test_copies_share_a_domain_only_when_no_unused_domain_is_left(domains, k, how):
    nodes = _nodes(domains)
    dom = {x.rank: placement._domain(x) for x in nodes}
    for r, copies in holders(nodes, k, how).items():
        used = [dom[c] for c in copies]
        if len(set(used)) < len(used):
            spare = [x for x in dom if x not in copies and dom[x] not in used]
            assert not spare, f"node {r}: copies on {copies} share a domain but {spare} were free"


@settings(max_examples=100, deadline=None)
@given(domains=DOMAINS, k=st.integers(1, 4), how=PLACEMENT)
def test_placement_is_a_pure_function_of_the_peer_list(domains, k, how):
    nodes = _nodes(domains)
    first = holders(nodes, k, how)
    again = holders([Node(x.rank, x.addr, x.domain) for x in reversed(nodes)], k, how)
    assert first == again
    assert all(replica_targets(nodes, r, k, how) == first[r][1:] for r in first)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), domains=DOMAINS, k=st.integers(1, 4), how=PLACEMENT)
def test_exact_survival_probability_equals_enumeration_with_survives(data, domains, k, how):
    nodes = _nodes(domains)
    f = data.draw(st.integers(0, len(nodes)))
    result = survival_probability(nodes, k, f, how)
    alive = _brute_alive(nodes, k, how, f)
    assert result.exact
    assert result.probability == alive / math.comb(len(nodes), f)
    assert result.all_survive == (alive == math.comb(len(nodes), f))


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(1, 9), k=st.integers(1, 4), how=PLACEMENT)
def test_survives_all_equals_enumeration_with_survives(data, n, k, how):
    f = data.draw(st.integers(0, n))
    assert survives_all(n, k, f, how) == (_brute_alive(n, k, how, f) == math.comb(n, f))
    example = losing_failure(n, k, f, how)
    if example is not None:
        assert len(example) == f and not survives(n, k, how, example)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), k=st.integers(1, 4))
def test_gemini_closed_form_matches_enumeration_for_group_placement(data, k):
    n = k * data.draw(st.integers(1, 12 // k))
    f = data.draw(st.integers(0, n))
    alive = _brute_alive(n, k, "group", f)
    assert placement._gemini_closed_form(n, k, f) == alive
    result = survival_probability(n, k, f, "group")
    assert result.exact and result.probability == alive / math.comb(n, f)


@pytest.mark.parametrize("n,k,f,how", [(13, 2, 4, "group"), (14, 3, 6, "group"), (16, 4, 7, "group"),
                                       (13, 3, 5, "ring"), (15, 2, 8, "ring"), (12, 5, 6, "ring")])
def test_group_and_ring_counts_match_enumeration_beyond_the_small_cases(n, k, f, how):
    h = holders(n, k, how)
    alive = sum(not any(set(c) <= set(fs) for c in h.values()) for fs in itertools.combinations(range(n), f))
    result = survival_probability(n, k, f, how)
    assert result.exact and result.probability == alive / math.comb(n, f)


def test_gemini_example_eight_nodes_two_replicas_two_failures():
    # a loss needs both nodes of one of 4 groups: 4 of C(8, 2) = 28 pairs
    result = survival_probability(8, 2, 2, "group")
    assert result.probability == pytest.approx(24 / 28) and result.exact and not result.all_survive
    assert "closed form" in result.method


def test_large_clusters_get_an_exact_answer_without_enumerating():
    result = survival_probability(1024, 2, 6, "ring")
    assert result.exact and 0 < result.probability < 1 and "counted" in result.method


def test_monte_carlo_when_there_are_too_many_failure_sets_to_enumerate(monkeypatch):
    nodes = _nodes(["a"] * 6 + ["b"] * 2 + ["c"] * 2)
    exact = survival_probability(nodes, 2, 4)
    assert exact.exact and "enumerated" in exact.method
    monkeypatch.setattr(placement, "MAX_ENUMERATED", 10)
    estimate = survival_probability(nodes, 2, 4, samples=20_000)
    assert not estimate.exact and estimate.method.startswith("Monte Carlo, 20000 samples")
    assert estimate.probability == pytest.approx(exact.probability, abs=0.02)
    assert survival_probability(nodes, 2, 4, samples=20_000) == estimate


def test_survival_rejects_impossible_failure_counts_and_unknown_ranks():
    with pytest.raises(ValueError, match="failures"):
        survival_probability(4, 2, 5)
    with pytest.raises(ValueError, match="failures"):
        survives_all(4, 2, -1)
    with pytest.raises(ValueError, match="not nodes"):
        survives(4, 2, "group", {9})


# -- the peer list ---------------------------------------------------------------------------

def test_parse_peers_reads_addresses_domains_comments_and_ipv6():
    text = """
    # rack A
    10.0.0.1:7070   domain=rackA
    node2.cluster:7070 domain=rackA   # the second one

    [fd00::3]:7070 domain=rackB
    [::1]:9000
    """
    nodes = parse_peers(text)
    assert nodes == [Node(0, "10.0.0.1:7070", "rackA"), Node(1, "node2.cluster:7070", "rackA"),
                     Node(2, "[fd00::3]:7070", "rackB"), Node(3, "[::1]:9000", None)]
    assert (nodes[2].host, nodes[2].port) == ("fd00::3", 7070)


def test_parse_peers_accepts_the_comma_separated_single_line_form():
    nodes = parse_peers("a:1 domain=r1, b:2 domain=r2,[::1]:3")
    assert nodes == [Node(0, "a:1", "r1"), Node(1, "b:2", "r2"), Node(2, "[::1]:3", None)]


@pytest.mark.parametrize("text,where,what", [
    ("a:1\nb:0\n", "line 2", "port"),
    ("a:1\nb:65536\n", "line 2", "port"),
    ("a:1\n\nb:x\n", "line 3", "port"),
    ("a:1\nb\n", "line 2", "no port"),
    ("a:1\n:9000\n", "line 2", "no host"),
    ("a:7070\n# c\nA:7070\n", "line 3", "already listed on line 1"),
    ("[::1]:7070\n[0:0::1]:7070\n", "line 2", "already listed"),
    ("::1:7070\n", "line 1", "brackets"),
    ("[nothex]:7070\n", "line 1", "IPv6"),
    ("a:1 rack=x\n", "line 1", "unknown field"),
    ("a:1 domain=\n", "line 1", "empty domain"),
    ("a:1 domain=x domain=y\n", "line 1", "twice"),
    ("a:1,,b:2", "line 1, entry 2", "empty entry"),
    ("a:1, b:2, a:1", "line 1, entry 3", "already listed"),
    ("# nothing\n\n", "line 1", "names no agent"),
    ("ho st:1 domain=a\n", "line 1", "no port"),
    ("h/st:1\n", "line 1", "host"),
])
def test_parse_peers_rejects_bad_lines_naming_the_line(text, where, what):
    with pytest.raises(PeerListError) as e:
        parse_peers(text)
    msg = str(e.value)
    assert msg.startswith(where + ":") and what in msg and "\n" not in msg
    assert isinstance(e.value, ValueError)


# -- the CLI ---------------------------------------------------------------------------------

def _run(argv, capsys):
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd")
    add_parser(sub)
    a = p.parse_args(["placement", *argv])
    rc = a.fn(a)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_prints_holders_survival_and_exact_probability(capsys):
    rc, out, err = _run(["--nodes", "4", "--replicas", "2", "--failures", "2"], capsys)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("group placement, 4 nodes, 2 copies")
    assert [ln.split() for ln in lines[3:7]] == [["0", "1"], ["1", "0"], ["2", "3"], ["3", "2"]]
    assert "survives every 2 simultaneous node failures: no (e.g. nodes 0, 1 fail" in out
    assert f"{4 / 6:.6f} (exact" in out


def test_cli_says_yes_when_every_failure_set_is_survived(capsys):
    rc, out, _ = _run(["--nodes", "6", "--replicas", "3", "--failures", "2", "--placement", "ring"], capsys)
    assert rc == 0
    assert "ring placement" in out
    assert "survives every 2 simultaneous node failures: yes" in out
    assert "1.000000 (exact" in out


def test_cli_reads_domains_and_addresses_from_the_peers_file(tmp_path, capsys):
    peers = tmp_path / "nodes.txt"
    peers.write_text("# two racks\nn0:7070 domain=a\nn1:7070 domain=a\n[fd00::2]:7070 domain=b\nn3:7070 domain=b\n")
    rc, out, err = _run(["--peers", str(peers), "--failures", "1"], capsys)
    assert rc == 0, err
    assert "4 nodes" in out
    assert "domain" in out and "[fd00::2]:7070" in out
    row0 = next(ln for ln in out.splitlines() if ln.startswith("0 "))
    assert row0.split() == ["0", "n0:7070", "a", "2", "(b)"]
    assert "survives every 1 simultaneous node failure: yes" in out


def test_cli_reports_monte_carlo_with_its_sample_count(tmp_path, capsys, monkeypatch):
    peers = tmp_path / "nodes.txt"
    peers.write_text("\n".join(f"n{i}:7070 domain={d}" for i, d in enumerate("aaaaaabbcc")) + "\n")
    monkeypatch.setattr(placement, "MAX_ENUMERATED", 10)
    rc, out, _ = _run(["--peers", str(peers), "--failures", "3"], capsys)
    assert rc == 0
    assert f"(Monte Carlo, {placement.MONTE_CARLO_SAMPLES} samples" in out


@pytest.mark.parametrize("argv,rc,what", [
    (["--replicas", "2"], 2, "--nodes N or --peers FILE"),
    (["--nodes", "0"], 2, "--nodes"),
    (["--nodes", "3", "--failures", "4"], 2, "--failures"),
    (["--nodes", "3", "--replicas", "0"], 2, "--replicas"),
])
def test_cli_rejects_unusable_flags_with_one_line_and_exit_2(argv, rc, what, capsys):
    got, out, err = _run(argv, capsys)
    assert got == rc and out == ""
    assert err.count("\n") == 1 and what in err


def test_cli_rejects_a_bad_peers_file_naming_the_file_and_line(tmp_path, capsys):
    peers = tmp_path / "nodes.txt"
    peers.write_text("n0:7070\nn1:99999\n")
    rc, out, err = _run(["--peers", str(peers)], capsys)
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and f"{peers}: line 2:" in err
    rc, _, err = _run(["--peers", str(tmp_path / "missing.txt")], capsys)
    assert rc == 1 and "cannot read peers file" in err


def test_cli_rejects_a_node_count_that_disagrees_with_the_peers_file(tmp_path, capsys):
    peers = tmp_path / "nodes.txt"
    peers.write_text("a:1\nb:2\n")
    rc, out, err = _run(["--peers", str(peers), "--nodes", "3"], capsys)
    assert rc == 2 and out == "" and "lists 2 agents" in err


def test_cli_rejects_an_unknown_placement_as_a_usage_error():
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd"))
    with pytest.raises(SystemExit) as e:
        p.parse_args(["placement", "--nodes", "4", "--placement", "random"])
    assert e.value.code == 2


def test_placement_command_and_module_never_import_torch():
    code = ("import sys, agents.placement, ckpt._placement_cli; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    p = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr
