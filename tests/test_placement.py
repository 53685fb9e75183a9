"""Replica placement (group/ring, failure domains), survival odds, the peer list, and ``ckpt placement``."""

from __future__ import annotations

import argparse
import itertools
import math
import subprocess
import sys

import pytest
from hypothesis import event, given, settings
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
from agents.mesh_placement import (
    Mesh,
    MeshError,
    max_failures_survived,
    parse_mesh,
    piece_label,
    piece_losing_failure,
    piece_survival_probability,
    pieces_survive,
    plan_copies,
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
    code = ("import sys, agents.placement, agents.mesh_placement, ckpt._placement_cli; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    p = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr


# -- the job's mesh: model replicas count as copies -------------------------------------------

def _mesh_spec(dims):
    return ",".join(f"{n}={s}" for n, s in dims)


def _brute_mesh_holders(dims, replicate, per_node, nodes, k, how):
    """Every piece's holder nodes by the policy, from first principles: row-major ranks, then the lead's targets."""
    names = [n for n, _ in dims]
    model = {}
    for rank, coords in enumerate(itertools.product(*(range(s) for _, s in dims))):
        piece = tuple((n, c) for n, c in zip(names, coords) if n not in replicate)
        model.setdefault(piece, set()).add(rank // per_node)
    node_list = _nodes([None] * nodes) if isinstance(nodes, int) else nodes
    out = {}
    for piece, held in model.items():
        have = set(held)
        for t in replica_targets(node_list, min(held), k, how):
            if len(have) >= k:
                break
            have.add(t)
        out[piece] = (held, have)
    return out


def _brute_unique_sets(nodes, k, how):
    """Every node's ranks' unique parts: on the node and its placement targets (rule 4)."""
    node_list = _nodes([None] * nodes) if isinstance(nodes, int) else nodes
    return [{n.rank, *replica_targets(node_list, n.rank, k, how)} for n in node_list]


def _brute_mesh_alive(holder_sets, n, f):
    return sum(not any(h <= set(c) for h in holder_sets) for c in itertools.combinations(range(n), f))


def _check_plan_against_brute(dims, replicate, per_node, nodes, k, how):
    mesh = Mesh(dims, frozenset(replicate), per_node)
    plan = plan_copies(mesh, nodes, k, how)
    n = mesh.nodes
    brute = _brute_mesh_holders(dims, replicate, per_node, nodes, k, how)
    assert {pc.piece: (set(pc.model_holders), set(pc.holders)) for pc in plan.pieces} == brute
    per_node_targets = min(k - 1, n - 1)
    assert plan.baseline_copies == mesh.world * per_node_targets
    assert plan.peer_copies == sum(len(have - held) for held, have in brute.values())
    assert sum(plan.sends.values()) == plan.peer_copies and set(plan.sends) == set(range(n))
    for pc in plan.pieces:
        assert pc.short_by == max(0, k - len(pc.holders))
        assert (pc.source_rank is None) == (not pc.targets)
        if pc.targets:
            assert pc.source_rank in pc.ranks and mesh.node_of(pc.source_rank) == pc.lead
    holder_sets = [have for _, have in brute.values()] + _brute_unique_sets(nodes, k, how)
    always = max(f for f in range(n + 1) if _brute_mesh_alive(holder_sets, n, f) == math.comb(n, f))
    assert max_failures_survived(plan) == always
    for f in range(n + 1):
        alive = _brute_mesh_alive(holder_sets, n, f)
        result = piece_survival_probability(plan, f)
        assert result.exact and result.probability == alive / math.comb(n, f)
        assert result.all_survive == (alive == math.comb(n, f))
        example = piece_losing_failure(plan, f)
        assert (example is None) == (alive == math.comb(n, f))
        if example is not None:
            assert len(example) == f and not pieces_survive(plan, example)
            assert any(h <= example for h in holder_sets)
    return plan


@st.composite
def _meshes(draw):
    """A mesh of up to 3 dims over N = 1..8 nodes of G = 1..4 ranks: the world N * G split into dim sizes."""
    n = draw(st.integers(1, 8))
    per_node = draw(st.integers(1, 4))
    rest, sizes = n * per_node, []
    for _ in range(draw(st.integers(0, 2))):
        size = draw(st.sampled_from([d for d in range(1, rest + 1) if rest % d == 0]))
        sizes.append(size)
        rest //= size
    sizes.append(rest)
    dims = [(f"d{i}", s) for i, s in enumerate(sizes)]
    replicate = {name for name, _ in dims if draw(st.booleans())}
    domains = draw(st.none() | st.lists(st.sampled_from([None, "a", "b", "c"]), min_size=n, max_size=n))
    return dims, replicate, per_node, (n if domains is None else _nodes(domains))


@settings(max_examples=600, deadline=None)
@given(mesh=_meshes(), k=st.integers(1, 4), how=PLACEMENT)
def test_mesh_copies_and_survival_equal_brute_force_over_every_failure_set(mesh, k, how):
    dims, replicate, per_node, nodes = mesh
    plan = _check_plan_against_brute(dims, replicate, per_node, nodes, k, how)
    event(f"nodes: {plan.nodes}")
    event(f"peer copies: {'none' if not plan.peer_copies else 'fewer' if plan.copy_fraction < 1 else 'as today'}")


@settings(max_examples=300, deadline=None)
@given(mesh=_meshes(), k=st.integers(1, 4), how=PLACEMENT)
def test_what_each_agent_sends_adds_up_to_the_calculators_plan(mesh, k, how):
    """The agents decide per shard (``shard_copies``, from the shard's holder groups and where the ranks are);
    the calculator per piece (``plan_copies``). Over every rank of a mesh the two must agree: the same whole
    copies from the same nodes to the same nodes, hence the same holders and the same survival figures."""
    from agents.mesh_placement import shard_copies

    dims, replicate, per_node, nodes = mesh
    m = Mesh(dims, frozenset(replicate), per_node)
    plan = plan_copies(m, nodes, k, how)
    node_list = _nodes([None] * nodes) if isinstance(nodes, int) else nodes
    node_of = {r: r // per_node for r in range(m.world)}
    sends = dict.fromkeys(range(m.nodes), 0)
    held = {pc.piece: set(pc.model_holders) for pc in plan.pieces}
    for pc in plan.pieces:
        groups = [list(pc.ranks)] if len(pc.ranks) > 1 else []  # a DTensor replicated along no dim has none
        for r in pc.ranks:
            targets = replica_targets(node_list, node_of[r], k, how)
            got = shard_copies(r, groups, node_of, targets, k)
            assert list(got) == targets  # every target gets the unique part at least
            for t, whole in got.items():
                if whole:
                    sends[node_of[r]] += 1
                    held[pc.piece].add(t)
    assert sends == dict(plan.sends)
    assert held == {pc.piece: set(pc.holders) for pc in plan.pieces}


def test_a_shard_with_two_groups_one_short_is_copied_whole_and_unknown_ranks_too():
    from agents.mesh_placement import shard_copies

    node_of = {0: 0, 1: 0, 2: 1, 3: 1}
    # a TP pair's norm (group on one node) beside an HSDP replica group across nodes: whole copies
    assert shard_copies(0, [[0, 1], [0, 2]], node_of, [1], 2) == {1: True}
    assert shard_copies(0, [[0, 2]], node_of, [1], 2) == {1: False}
    assert shard_copies(0, [[0, 2]], {0: 0}, [1], 2) == {1: True}  # where rank 2 is, unknown
    assert shard_copies(0, [], node_of, [1, 2], 3) == {1: True, 2: True}
    # one group on one node, three copies wanted: the lead adds two, its group mate sends its unique part
    assert shard_copies(0, [[0, 1]], node_of, [1, 2], 3) == {1: True, 2: True}
    assert shard_copies(1, [[0, 1]], node_of, [1, 2], 3) == {1: False, 2: False}


def test_hsdp_2x2_on_2_nodes_survives_one_failure_with_no_peer_copy():
    # dp_replicate is the outer dim, so the two replicas of each shard run on different nodes
    plan = _check_plan_against_brute([("dp_replicate", 2), ("dp_shard", 2)], {"dp_replicate"}, 2, 2, 2, "group")
    assert [pc.model_holders for pc in plan.pieces] == [(0, 1), (0, 1)]
    assert plan.peer_copies == 0 and plan.baseline_copies == 4 and plan.copy_fraction == 0
    assert max_failures_survived(plan) == 1
    assert piece_survival_probability(plan, 1).all_survive


def test_tp_inside_a_node_with_dp_across_nodes_needs_no_peer_copy():
    plan = _check_plan_against_brute([("dp", 2), ("tp", 4)], {"dp"}, 4, 2, 2, "group")
    assert len(plan.pieces) == 4 and all(pc.model_holders == (0, 1) for pc in plan.pieces)
    assert plan.peer_copies == 0 and max_failures_survived(plan) == 1


def test_replicas_on_the_same_node_still_get_peer_copies():
    # dp is the inner dim: both replicas of a tp shard run on one node, which is no protection
    plan = _check_plan_against_brute([("tp", 2), ("dp", 2)], {"dp"}, 2, 2, 2, "group")
    assert [(pc.model_holders, pc.targets, pc.source_rank) for pc in plan.pieces] == [((0,), (1,), 0), ((1,), (0,), 2)]
    assert plan.peer_copies == 2 and plan.baseline_copies == 4 and plan.copy_fraction == 0.5
    assert dict(plan.sends) == {0: 1, 1: 1}


@pytest.mark.parametrize("dims,copies", [
    ([("pp", 4), ("dp", 2)], 4),   # each stage's replicas share a node: one copy per stage
    ([("dp", 2), ("pp", 4)], 0),   # each stage's replicas on two nodes already
])
def test_pipeline_stages_times_dp_replicas(dims, copies):
    plan = _check_plan_against_brute(dims, {"dp"}, 2, 4, 2, "group")
    assert len(plan.pieces) == 4 and plan.peer_copies == copies and plan.baseline_copies == 8
    assert max_failures_survived(plan) == 1


def test_hsdp_with_k_above_the_model_replicas_adds_only_the_missing_copies():
    plan = _check_plan_against_brute([("dp_replicate", 2), ("dp_shard", 4), ("tp", 2)], {"dp_replicate"}, 2, 8, 3,
                                     "group")
    assert all(len(pc.targets) == 1 and len(pc.holders) == 3 for pc in plan.pieces)
    assert plan.peer_copies == 8 and plan.baseline_copies == 32 and plan.copy_fraction == 0.25
    assert max_failures_survived(plan) == 2


def test_a_piece_stays_short_when_there_are_fewer_nodes_than_copies_wanted():
    plan = plan_copies(Mesh([("pp", 2), ("tp", 2)], frozenset(), 2), 2, 4)
    assert all(pc.short_by == 2 and len(pc.holders) == 2 for pc in plan.pieces)


def test_without_replicate_dims_survival_equals_the_node_level_placement_at_scale():
    # one rank per node and nothing replicated: every piece's holders are its node's holders
    plan = plan_copies(Mesh([("pp", 1024)], frozenset(), 1), 1024, 2, "ring")
    for f in (2, 3):
        got = piece_survival_probability(plan, f)
        assert got.exact and got.probability == pytest.approx(survival_probability(1024, 2, f, "ring").probability,
                                                              rel=1e-12)
    assert max_failures_survived(plan) == 1


def test_mesh_survival_falls_back_to_enumeration_then_seeded_monte_carlo(monkeypatch):
    plan = plan_copies(Mesh([("pp", 6)], frozenset(), 1), 6, 2, "ring")
    exact = piece_survival_probability(plan, 4)
    assert exact.exact and "inclusion-exclusion" in exact.method
    # the ring's inclusion-exclusion takes 35 terms here, enumeration C(6, 4) = 15 failure sets
    monkeypatch.setattr(placement, "MAX_ENUMERATED", 20)
    enumerated = piece_survival_probability(plan, 4)
    assert enumerated.method == "exact: enumerated all 15 failure sets"
    assert enumerated.probability == exact.probability == survival_probability(6, 2, 4, "ring").probability
    monkeypatch.setattr(placement, "MAX_ENUMERATED", 10)
    estimate = piece_survival_probability(plan, 4, samples=20_000)
    assert not estimate.exact and estimate.method == "Monte Carlo, 20000 samples (seed 0)"
    assert estimate.probability == pytest.approx(exact.probability, abs=0.02)
    assert piece_survival_probability(plan, 4, samples=20_000) == estimate


def test_mesh_ranks_are_row_major_and_nodes_hold_consecutive_ranks():
    mesh = Mesh([("a", 2), ("b", 3), ("c", 2)], frozenset({"b"}), 4)
    assert [mesh.coords(r) for r in range(mesh.world)] == list(itertools.product(range(2), range(3), range(2)))
    assert (mesh.world, mesh.nodes, mesh.node_of(11)) == (12, 3, 2)
    assert mesh.pieces()[(("a", 1), ("c", 0))] == (6, 8, 10)
    assert piece_label((("a", 1), ("c", 0))) == "a=1,c=0" and piece_label(()) == "(all)"


def test_bytes_fraction_weighs_pieces_by_their_shard_size():
    plan = plan_copies(Mesh([("tp", 2), ("dp", 2)], frozenset({"dp"}), 2), 2, 2)
    sizes = {(("tp", 0),): 300, (("tp", 1),): 100}
    # today: 4 ranks each send their shard once (300 + 300 + 100 + 100); now: one of each piece
    assert plan.bytes_fraction(sizes) == pytest.approx(400 / 800)
    with pytest.raises(KeyError, match="tp=1"):
        plan.bytes_fraction({(("tp", 0),): 1})


@pytest.mark.parametrize("spec,what", [
    ("", "names no dim"),
    ("dp=2,,tp=2", "extra comma"),
    ("dp", "no size"),
    ("dp=0", "at least 1"),
    ("dp=two", "whole number"),
    ("1dp=2", "not an identifier"),
    ("dp=2,dp=2", "twice"),
])
def test_parse_mesh_rejects_bad_specs(spec, what):
    with pytest.raises(MeshError, match=what) as e:
        parse_mesh(spec)
    assert isinstance(e.value, ValueError)


def test_mesh_rejects_unknown_replicate_dims_and_uneven_nodes():
    with pytest.raises(MeshError, match="not in the mesh"):
        Mesh([("dp", 2)], frozenset({"pp"}), 1)
    with pytest.raises(MeshError, match="not a multiple"):
        Mesh([("dp", 3)], frozenset(), 2)
    with pytest.raises(MeshError, match="at least 1"):
        Mesh([("dp", 2)], frozenset(), 0)
    with pytest.raises(ValueError, match="so 2 nodes, not 3"):
        plan_copies(Mesh([("dp", 4)], frozenset(), 2), 3, 2)
    with pytest.raises(ValueError, match="failures"):
        piece_survival_probability(plan_copies(Mesh([("dp", 4)], frozenset(), 2), 2, 2), 3)


# -- ckpt placement --mesh --------------------------------------------------------------------

_NUM = r"([0-9.]+)"


def _mesh_cli_figures(out):
    """The numbers ``ckpt placement --mesh`` prints: peer copies, today's, ratio, yes/no, largest F, probability."""
    import re

    copies = re.search(rf"peer copies per save: {_NUM} shards? \(today {_NUM}: .*\); {_NUM} of today's", out)
    yes = re.search(r"survives every \d+ simultaneous node failures?: (yes|no)", out)
    best = re.search(rf"always survived: {_NUM}\n", out)
    prob = re.search(rf"node failures?: {_NUM} \((.*)\)\n", out)
    return (int(copies[1]), int(copies[2]), float(copies[3]), yes[1] == "yes", int(best[1]), float(prob[1]),
            prob[2])


@pytest.mark.parametrize("dims,replicate,per_node,n,k,f,how,domains", [
    ([("dp_replicate", 2), ("dp_shard", 2)], {"dp_replicate"}, 2, 2, 2, 1, "group", None),
    ([("dp_replicate", 2), ("dp_shard", 4), ("tp", 2)], {"dp_replicate"}, 2, 8, 2, 2, "group", None),
    ([("dp_replicate", 2), ("dp_shard", 4), ("tp", 2)], {"dp_replicate"}, 2, 8, 3, 3, "ring", None),
    ([("tp", 2), ("dp", 3)], {"dp"}, 3, 2, 2, 1, "group", None),
    ([("pp", 3), ("dp", 2), ("tp", 2)], {"dp"}, 2, 6, 2, 2, "group", "aabbcc"),
    ([("pp", 4), ("dp", 2)], set(), 1, 8, 3, 4, "ring", "abababab"),
])
def test_cli_mesh_figures_equal_brute_force(dims, replicate, per_node, n, k, f, how, domains, tmp_path, capsys):
    argv = ["--mesh", _mesh_spec(dims), "--replicate", ",".join(sorted(replicate)) or "none",
            "--ranks-per-node", str(per_node), "--replicas", str(k), "--failures", str(f), "--placement", how]
    if domains is None:
        argv += ["--nodes", str(n)]
        nodes = n
    else:
        peers = tmp_path / "nodes.txt"
        peers.write_text("".join(f"n{i}:7070 domain={d}\n" for i, d in enumerate(domains)))
        argv += ["--peers", str(peers)]
        nodes = _nodes(domains)
    rc, out, err = _run(argv, capsys)
    assert rc == 0 and err == ""
    brute = _brute_mesh_holders(dims, replicate, per_node, nodes, k, how)
    holder_sets = [have for _, have in brute.values()] + _brute_unique_sets(nodes, k, how)
    copies = sum(len(have - held) for held, have in brute.values())
    today = math.prod(s for _, s in dims) * min(k - 1, n - 1)
    alive = _brute_mesh_alive(holder_sets, n, f)
    always = max(x for x in range(n + 1) if _brute_mesh_alive(holder_sets, n, x) == math.comb(n, x))
    got = _mesh_cli_figures(out)
    assert got[:5] == (copies, today, pytest.approx(round(copies / today, 3)), alive == math.comb(n, f), always)
    assert got[5] == pytest.approx(alive / math.comb(n, f), abs=5e-7) and got[6].startswith("exact")
    rows = [ln for ln in out.splitlines() if ln.split(" ", 1)[0] in {piece_label(p) for p in brute}]
    assert len(rows) == len(brute)


def test_cli_mesh_says_which_failures_lose_a_piece(capsys):
    rc, out, _ = _run(["--nodes", "2", "--mesh", "tp=2,dp=2", "--replicate", "dp", "--replicas", "1",
                       "--failures", "1"], capsys)
    assert rc == 0
    assert "survives every 1 simultaneous node failure: no (e.g. node 0 fails: no copy of piece tp=0 is left)" in out
    assert "peer copies per save: 0 shards (today 0: every rank's shard to 0 peers)" in out


def test_cli_mesh_caps_the_piece_rows_and_says_how_many_are_left_out(capsys):
    from ckpt import _placement_cli

    rc, out, _ = _run(["--mesh", "dp=2,pp=16,tp=4", "--replicate", "dp", "--ranks-per-node", "4",
                       "--failures", "2"], capsys)
    assert rc == 0
    pieces = 16 * 4
    assert f"({pieces - _placement_cli.MAX_PIECE_ROWS} more pieces not shown)" in out
    assert f"pieces: {pieces}; on 2+ nodes by the model's replicas alone: {pieces}; with peer copies: 0" in out
    assert "32 nodes of 4 ranks" in out and "1 of 32 nodes" not in out
    assert "at most 0 (node 0), 0.00 on average; 32 of 32 nodes send none" in out


@pytest.mark.parametrize("argv,what", [
    (["--nodes", "2", "--mesh", "dp=2,tp=2"], "give --replicate"),
    (["--nodes", "2", "--mesh", "dp=2,tp=x", "--replicate", "dp"], "--mesh: mesh dim 'tp'"),
    (["--nodes", "2", "--mesh", "dp=2,tp=2", "--replicate", "pp"], "--replicate names pp"),
    (["--nodes", "3", "--mesh", "dp=2,tp=2", "--replicate", "dp"], "do not split evenly over 3 nodes"),
    (["--nodes", "2", "--mesh", "dp=2,tp=2", "--replicate", "dp", "--ranks-per-node", "1"], "the mesh has 4"),
    (["--mesh", "dp=2,tp=2", "--replicate", "dp", "--ranks-per-node", "3"], "not a multiple of --ranks-per-node"),
    (["--mesh", "dp=2,tp=2", "--replicate", "dp", "--ranks-per-node", "0"], "--ranks-per-node must be"),
    (["--mesh", "dp=2,tp=2", "--replicate", "dp"], "--nodes N, --peers FILE or --ranks-per-node G"),
    (["--nodes", "2", "--mesh", "dp=2,tp=2", "--replicate", "dp", "--failures", "3"], "--failures"),
    (["--nodes", "2", "--mesh", "dp=2,tp=2", "--replicate", "dp", "--replicas", "0"], "--replicas"),
    (["--nodes", "2", "--replicate", "dp"], "give --mesh"),
    (["--nodes", "2", "--ranks-per-node", "2"], "give --mesh"),
])
def test_cli_mesh_rejects_unusable_flags_with_one_line_and_exit_2(argv, what, capsys):
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and what in err


# -- memory-only nodes -----------------------------------------------------------------------------

def test_training_nodes_copy_to_the_memory_pool_spread_evenly_and_the_pool_holds_nothing_of_its_own():
    from agents.placement import parse_peers

    text = "".join(f"t{i}:1\n" for i in range(6)) + "".join(f"m{i}:1 role=memory\n" for i in range(3))
    nodes = parse_peers(text)
    pool = {6, 7, 8}
    for k in (2, 3, 4):
        load = dict.fromkeys(pool, 0)
        for r in range(6):
            t = replica_targets(nodes, r, k)
            assert len(t) == k - 1 and len(set(t)) == k - 1 and r not in t
            assert set(t) <= pool or len(t) > len(pool)  # the pool first; trainers only past its size
            for x in t:
                if x in pool:
                    load[x] += 1
        assert max(load.values()) - min(load.values()) <= 1, (k, load)
    for m in pool:
        assert replica_targets(nodes, m, 2) == []
    h = holders(nodes, 2)
    assert set(h) == set(range(6))  # a memory node has no checkpoint of its own to lose
    assert survives(nodes, 2, "group", {6})  # losing one memory node loses no checkpoint
    assert not survives(nodes, 2, "group", {0, replica_targets(nodes, 0, 2)[0]})


def test_a_pool_copy_goes_to_another_failure_domain_where_one_is_left():
    from agents.placement import parse_peers

    nodes = parse_peers("a:1 domain=r1\nb:1 domain=r2\nm1:1 domain=r1 role=memory\nm2:1 domain=r2 role=memory\n")
    assert replica_targets(nodes, 0, 2) == [3]  # a is in r1: its copy goes to m2, in r2
    assert replica_targets(nodes, 1, 2) == [2]
    assert sorted(replica_targets(nodes, 0, 3)) == [2, 3]


def test_a_role_other_than_train_memory_or_retired_is_refused_with_the_line():
    from agents.placement import PeerListError, parse_peers

    with pytest.raises(PeerListError, match="line 2: role 'spare' is not train, memory or retired"):
        parse_peers("a:1\nb:1 role=spare\n")
    with pytest.raises(PeerListError, match="role given twice"):
        parse_peers("a:1 role=memory role=train\n")
    assert [n.role for n in parse_peers("a:1\nb:1 role=memory domain=r\n")] == ["train", "memory"]


def test_a_retired_node_is_no_peer_and_placement_goes_on_over_the_nodes_left():
    """``role=retired`` keeps a line (so the later nodes keep their ranks) but not the node: it is not a
    peer, holds no copies, and placement is that of the cluster without it; the node itself cannot run."""
    from agents.placement import parse_peers, replica_targets
    from agents.replication import Membership

    nodes = parse_peers("a:1\nb:1\nc:1 role=retired\nd:1\n")
    assert [n.role for n in nodes] == ["train", "train", "retired", "train"]
    m = Membership(nodes, 0, 2, "ring", 3.0)
    assert set(m.peers) == {1, 3} and m.alive() == {0, 1, 3}
    assert [n.rank for n in m.active()] == [0, 1, 3]
    for r in (0, 1, 3):
        assert 2 not in m.desired(r, {0, 1, 3}) and 2 not in m.fallbacks(r, 3)
    live = [n for n in nodes if n.role != "retired"]
    assert m.desired(1, {0, 1, 3}) == [1] + replica_targets(live, 1, 2, "ring")  # 1 -> 3: the ring skips 2
    with pytest.raises(ValueError, match="node 2 is retired"):
        Membership(nodes, 2, 2, "ring", 3.0)
    # retiring a running member: it stops being a peer, and its copies go to the next node
    m = Membership(parse_peers("a:1\nb:1\nc:1\n"), 0, 2, "ring", 3.0)
    assert m.targets(0) == [1]
    m.retire(parse_peers("a:1\nb:1 role=retired\nc:1\n")[1])
    assert m.targets(0) == [2] and 1 not in m.peers and 1 not in m.watched
    assert m.mark("alive", 1) is False and 1 not in m.alive()
