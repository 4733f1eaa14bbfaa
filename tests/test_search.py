"""The search without a GPU: planning, deduplicated compile jobs, failure bookkeeping, and the
measuring-process protocol (crashes, hangs, lost CUDA contexts) driven by fake measuring children.

gen.tune.search and gen.tune.measuring are imported inside the tests, not here: each fake child is
spawned from this module and should start in a fraction of a second, without importing TileLang.
"""
import os
import time

import pytest

from schedules.arch import get_arch
from schedules.problem import Problem

H200 = get_arch("sm_90a")
QKV = Problem.make(n=12288, k=4096)


def _search():
    import gen.tune.search

    return gen.tune.search


def _measuring():
    import gen.tune.measuring

    return gen.tune.measuring


def _spec():
    from schedules.cost import GpuSpec

    return GpuSpec.for_arch(H200)


def test_plan_keeps_the_top_ranked():
    from schedules.cost import rank

    s = _search()
    searches = s.plan([(QKV, 1), (QKV, 4096)], H200, _spec(), top=5)
    assert [(x.problem, x.bucket) for x in searches] == [(QKV, 1), (QKV, 4096)]
    for x in searches:
        ranked = rank(QKV, x.bucket, H200, _spec())
        got = [r.schedule for r in x.results]
        families = {sch.family for sch in s.within_reach(ranked, QKV, x.bucket, _spec())}
        assert 5 <= len(got) <= max(5, 2 * len(families)) and got == sorted(got, key=ranked.index)
        assert ranked[0] in got
        # every family's best is measured, whatever the model thinks of it across families (unless the
        # model puts the whole family out of reach, test_families_far_out_of_reach_are_not_measured)
        for fam in {sch.family for sch in s.within_reach(ranked, QKV, x.bucket, _spec())}:
            assert next(sch for sch in ranked if sch.family == fam) in got
        assert [r.estimate_us for r in x.results] == sorted(r.estimate_us for r in x.results)
        assert all(r.us is None and r.error is None for r in x.results)
    with pytest.raises(ValueError, match="--top"):
        s.plan([(QKV, 1)], H200, _spec(), top=0)


def test_each_family_gets_half_of_the_selection():
    from schedules import stream_mma, stream_wgmma
    from schedules.registry import Schedule

    s = _search()
    mma = [Schedule("stream_mma", stream_mma.Knobs(split_k=k)) for k in (1, 2, 3, 4, 6, 8)]
    wg = [Schedule("stream_wgmma", stream_wgmma.Knobs(stages=n)) for n in (3, 4, 5, 6)]
    ranked = mma + wg                          # the model puts every stream_mma first
    got = s.top_of_each_family(ranked, 6)
    assert got == mma[:3] + wg[:3]             # three of each, in the model's order
    got = s.top_of_each_family(mma + wg[:1], 6)
    assert got == mma[:5] + wg[:1]             # a family with fewer leaves its places to the rest
    assert s.top_of_each_family(ranked, 1) == mma[:1]


def test_first_round_spends_no_places_on_variants_of_one_kernel():
    from dataclasses import replace

    from schedules.registry import Schedule

    s = _search()
    (search,) = s.plan([(QKV, 1)], H200, _spec(), top=12)
    picked = [r.schedule for r in search.results if r.schedule.family == "stream_mma"]
    assert picked
    rest = lambda sch: replace(sch.knobs, sum_slices=False, pdl=False)
    assert len({rest(sch) for sch in picked}) == len(picked)
    # the better-ranked variant goes in (both measured faster, docs/performance.md "sum_slices"); the
    # second round's neighbours move the variant axes like any other
    best = picked[0]
    assert best.knobs.sum_slices
    moved = s.neighbours(best, QKV, H200)
    assert Schedule("stream_mma", replace(best.knobs, sum_slices=False)) in moved


def test_first_round_keeps_the_ring_variant_where_it_was_measured_faster():
    from dataclasses import replace

    from schedules.registry import Schedule

    s = _search()
    # ring (the wgmmas a k-step at a time) is a variant axis: one of its values per kernel goes in,
    # the one its measured factor favours (D = 8 0.95-0.98x at M = 128-256, slower at M = 16-32,
    # docs/performance.md "ring"); a block_k 64 kernel has 4 k-steps, which 8 does not divide
    for m, ring in ((16, 0), (128, 8)):
        kept = [x for x in s.first_round_ranking(QKV, m, H200, _spec())
                if x.family == "stream_wgmma" and x.knobs.block_k == 128]
        # (scale_on_acc, another variant axis, excludes ring: a point may keep that variant instead)
        rings = {x.knobs.ring for x in kept if not x.knobs.scale_on_acc}
        assert kept and rings == {ring}, (m, rings)
        assert len({replace(x.knobs, ring=0, scale_on_acc=False) for x in kept}) == len(kept)
    ringed = kept[0]      # the local rounds step back to D = 0
    assert Schedule("stream_wgmma", replace(ringed.knobs, ring=0)) in s.neighbours(ringed, QKV, H200)


def test_first_round_keeps_stream_mmas_early_start_variant_up_to_m_8():
    s = _search()
    # early_start with late_trigger measured 0.94x of neither up to M = 8 (docs/performance.md
    # "late_trigger"): the first round's stream_mma points there keep it (with factors of 1.06 / 0.96
    # they all went without, and a cold tune never measured the table's M = 1-8 winners); from M = 64
    # on, the model's penalty for early_start stays.
    kept = [x for x in s.first_round_ranking(QKV, 1, H200, _spec(), families=("stream_mma",))
            if x.knobs.pdl or x.knobs.cluster_reduce]
    assert kept and all(x.knobs.early_start and x.knobs.late_trigger for x in kept[:12])
    late = [x for x in s.first_round_ranking(QKV, 64, H200, _spec(), families=("stream_mma",))
            if x.knobs.pdl or x.knobs.cluster_reduce]
    assert late and not any(x.knobs.early_start for x in late[:12])


def test_compile_jobs_are_deduplicated_across_buckets():
    s = _search()
    meas = _measuring()
    small = s.plan([(QKV, b) for b in (1, 2)], H200, _spec(), top=4)
    # same padded tiles (8 and 16 rows): the same selection, compiled once
    assert [r.schedule for r in small[0].results] == [r.schedule for r in small[1].results]
    assert len(meas.compile_jobs(small)) == len(small[0].results)
    everything = s.plan([(QKV, b) for b in (1, 16, 256, 4096)], H200, _spec(), top=4)
    jobs = meas.compile_jobs(everything)
    assert len(jobs) == len(set(jobs)) < sum(len(x.results) for x in everything)
    assert set(jobs) == {(QKV, r.schedule) for x in everything for r in x.results}


def test_retune_measures_the_incumbent_once():
    from runtime.table import TunedTable
    from schedules import marlin_mma, stream_mma
    from schedules.registry import Schedule

    s = _search()
    incumbent = Schedule("stream_mma", stream_mma.Knobs(1, 4, 4, 16, ahead=2))
    too_big = Schedule("marlin_mma", marlin_mma.Knobs(block_m=16, block_n=512, block_k=64, warps_m=1, warps_n=1,
                                                     num_stages=3))
    assert incumbent.module.check(QKV, incumbent.knobs, H200) is None
    assert too_big.module.check(QKV, too_big.knobs, H200) is not None
    table = TunedTable()
    table.record(QKV, 1, incumbent, 11.0)
    table.record(QKV, 16, too_big, 20.0)
    searches = s.plan([(QKV, 1), (QKV, 16), (QKV, 64)], H200, _spec(), top=3)
    assert all(incumbent not in [r.schedule for r in x.results] for x in searches)
    assert s.add_incumbents(searches, table, H200, _spec(), families=["marlin_mma"]) == 0   # not searched
    assert s.add_incumbents(searches, table, H200, _spec()) == 1       # only bucket 1; the invalid one is left out
    assert s.add_incumbents(searches, table, H200, _spec()) == 0       # never twice
    one = next(x for x in searches if x.bucket == 1)
    assert [r.schedule for r in one.results].count(incumbent) == 1 and len(one.results) == 4


def test_a_bucket_measures_its_neighbours_kernels_and_keeps_one_that_is_within_the_tolerance():
    from runtime.table import TunedTable
    from schedules import stream_mma
    from schedules.registry import Schedule

    s = _search()
    at_2 = Schedule("stream_mma", stream_mma.Knobs(1, 4, 4, 16, ahead=2))
    at_4 = Schedule("stream_mma", stream_mma.Knobs(1, 8, 4, 8, ahead=2))
    table = TunedTable()
    table.record(QKV, 2, at_2, 9.0)
    table.record(QKV, 4, at_4, 9.1)
    searches = s.plan([(QKV, b) for b in (1, 2, 8)], H200, _spec(), top=2)
    assert s.add_siblings(searches, table, H200, _spec()) >= 3
    one, two, eight = searches
    assert one.siblings == {at_2} and two.siblings == {at_4} and eight.siblings == {at_4}
    assert at_2 in [r.schedule for r in one.results] and at_4 in [r.schedule for r in eight.results]
    # timed: the fastest at M = 1 is another candidate, the sibling 0.9 % behind it
    for r in one.results:
        r.us = 9.0 if r.schedule != at_2 else 9.08
    assert one.winner().schedule == at_2
    next(r for r in one.results if r.schedule == at_2).us = 9.2                # 2.2 % behind: not kept
    assert one.winner().schedule != at_2 and one.winner().us == 9.0
    next(r for r in one.results if r.schedule == at_2).error = "wrong result"   # never a failed one
    assert one.winner().us == 9.0


def test_a_tune_starts_from_the_twins_winners_and_the_best_estimated_transfers():
    import dataclasses

    from runtime.fallback import TunedWinner, nearest_transfers, ranked_transfers
    from runtime.table import TunedTable
    from schedules import stream_mma
    from schedules.registry import Schedule

    s = _search()
    bf16 = dataclasses.replace(QKV, dtype="bfloat16")
    twin_winner = Schedule("stream_mma", stream_mma.Knobs(1, 4, 4, 16, ahead=2))
    other_shape = Schedule("stream_mma", stream_mma.Knobs(1, 8, 4, 8, ahead=3))
    table = TunedTable()
    table.record(QKV, 1, twin_winner, 11.0)          # the fp16 twin, tuned at bucket 1 only
    winners = [TunedWinner(QKV, 1, twin_winner), TunedWinner(dataclasses.replace(QKV, n=4096), 64, other_shape)]
    searches = s.plan([(bf16, 1), (bf16, 64)], H200, _spec(), top=1)
    before = {x.bucket: [r.schedule for r in x.results] for x in searches}
    added = s.add_transfers(searches, table, winners, H200, _spec(), per_bucket=1)
    after = {x.bucket: [r.schedule for r in x.results] for x in searches}
    best_estimated = {b: ranked_transfers(bf16, b, H200, _spec(), winners)[0] for b in (1, 64)}
    assert twin_winner in after[1]                                   # the twin's bucket-1 winner
    assert all(best_estimated[b] in after[b] for b in (1, 64))
    assert all(s in after[b] for b in (1, 64) for s in nearest_transfers(bf16, b, H200, winners))   # the fallback's
    assert added == sum(len(after[b]) - len(before[b]) for b in (1, 64)) > 0
    assert s.add_transfers(searches, table, winners, H200, _spec(), per_bucket=1) == 0   # never twice
    # the problem's own winner in that table (the shipped one, for a tune into a cache of its own)
    shipped = TunedTable()
    own_winner = twin_winner
    shipped.record(bf16, 64, own_winner, 9.0)
    fresh = s.plan([(bf16, 64)], H200, _spec(), top=1)
    s.add_transfers(fresh, shipped, [], H200, _spec())
    assert own_winner in [r.schedule for r in fresh[0].results]
    assert s.add_transfers(s.plan([(bf16, 1)], H200, _spec(), top=1), table, winners, H200, _spec(),
                           families=["marlin_mma"]) == 0                                # not searched
    # twins_only (a re-tuned bucket): the twin's winner, none of the other shapes' transfers
    again = s.plan([(bf16, 1)], H200, _spec(), top=1)
    planned = [r.schedule for r in again[0].results]
    s.add_transfers(again, table, winners, H200, _spec(), per_bucket=1, twins_only=True)
    assert [r.schedule for r in again[0].results] == planned + ([] if twin_winner in planned else [twin_winner])


def test_variants_of_the_winners_join_their_buckets():
    from dataclasses import replace

    from runtime.table import TunedTable
    from schedules import stream_mma, stream_wgmma
    from schedules.registry import Schedule

    s = _search()
    small = Schedule("stream_mma", stream_mma.Knobs(1, 4, 4, 2, ahead=2, fold_zero_point=True, cluster_reduce=True))
    large = Schedule("stream_wgmma", stream_wgmma.Knobs(128, 1, 2, 64, 4))
    table = TunedTable()
    table.record(QKV, 1, small, 10.0)
    table.record(QKV, 256, large, 40.0)
    searches = s.plan([(QKV, 1), (QKV, 256), (QKV, 4096)], H200, _spec(), top=2)
    changes = {"stream_mma": [{"sum_slices": True, "pdl": False}, {"sum_slices": True, "pdl": True}],
               "stream_wgmma": [{"producer_warp": True}]}
    # pdl with cluster_reduce is refused by check(), a producer warp needs release barriers: only one is valid;
    # bucket 4096 has no winner to vary
    assert s.add_variants(searches, table, changes, H200, _spec()) == 1
    one = next(x for x in searches if x.bucket == 1)
    assert Schedule("stream_mma", replace(small.knobs, sum_slices=True)) in [r.schedule for r in one.results]
    assert s.add_variants(searches, table, changes, H200, _spec()) == 0      # never twice
    assert s.add_variants(searches, table, changes, H200, _spec(), families=["marlin_mma"]) == 0


def test_seeds_from_a_sweep_join_the_matching_buckets():
    from schedules import stream_mma, stream_wgmma
    from schedules.registry import Schedule

    s = _search()
    fast = Schedule("stream_wgmma", stream_wgmma.Knobs(8, 1, 1, 64, 8, split_k=4))
    slow = Schedule("stream_mma", stream_mma.Knobs(1, 4, 4, 16, ahead=2))
    wrong = Schedule("stream_mma", stream_mma.Knobs(1, 8, 4, 16, ahead=2))

    def timing(sched, us, error=None):
        return {"schedule": sched.to_dict(), "name": sched.name, "us": us, "error": error}

    records = [{"problem": {"n": 12288, "k": 4096, "group": 128, "dtype": "float16", "bits": 4}, "m": 1,
                "results": [timing(slow, 20.0), timing(fast, 9.0), timing(wrong, 5.0, error="wrong: rel err 0.5")]},
               {"problem": {"n": 4096, "k": 4096, "group": 128, "dtype": "float16", "bits": 4}, "m": 1,
                "results": [timing(fast, 3.0)]}]
    searches = s.plan([(QKV, 1), (QKV, 16)], H200, _spec(), top=2)
    assert s.add_seeds(searches, records, H200, _spec(), per_bucket=1) == 1     # the fastest correct, at M=1 only
    one, sixteen = searches
    assert one.results[-1].schedule == fast and one.results[-1].us is None      # measured again by the tune
    assert all(r.schedule != fast for r in sixteen.results)
    assert s.add_seeds(searches, records, H200, _spec(), per_bucket=2, families=["stream_mma"]) == 1
    assert one.results[-1].schedule == slow
    with pytest.raises(ValueError, match="record 0"):
        s.add_seeds(searches, [{"m": 1}], H200, _spec())


def test_neighbours_move_one_knob_or_a_coupled_pair():
    import dataclasses

    from schedules import stream_wgmma
    from schedules.registry import Schedule

    s = _search()
    o_proj = Problem.make(n=4096, k=4096)
    plain = Schedule("stream_wgmma", stream_wgmma.Knobs(64, 1, 1, 64, 6, split_k=2))
    near = s.neighbours(plain, o_proj, H200)
    assert near == s.neighbours(plain, o_proj, H200) and plain not in near and len(set(near)) == len(near)
    assert all(n.module.check(o_proj, n.knobs, H200) is None for n in near)
    changed = [{f.name for f in dataclasses.fields(n.knobs) if getattr(n.knobs, f.name) != getattr(plain.knobs, f.name)}
               for n in near]
    assert all(1 <= len(c) <= 2 for c in changed)
    for name, values in (("stages", (4, 8)), ("split_k", (1, 4)), ("block_m", (32, 128))):
        for v in values:      # one step either way along an axis, never two
            assert Schedule("stream_wgmma", dataclasses.replace(plain.knobs, **{name: v})) in near
    assert Schedule("stream_wgmma", dataclasses.replace(plain.knobs, split_k=8)) not in near
    # the producer warp is only valid with release barriers: it comes as a pair
    assert Schedule("stream_wgmma", dataclasses.replace(plain.knobs, release_barriers=True, producer_warp=True)) in near
    assert {"producer_warp"} not in changed
    # a value off the searched grid (an unsearched setmaxnreg from a sweep's seed) stays while other
    # axes move, and moves onto the grid along its own axis
    seeded = Schedule("stream_wgmma", stream_wgmma.Knobs(256, 1, 2, 64, 4, release_barriers=True, producer_warp=True,
                                                         setmaxnreg=True))
    assert seeded.module.check(o_proj, seeded.knobs, H200) is None
    around = s.neighbours(seeded, o_proj, H200)
    assert Schedule("stream_wgmma", dataclasses.replace(seeded.knobs, stages=6)) in around
    assert Schedule("stream_wgmma", dataclasses.replace(seeded.knobs, block_m=176, setmaxnreg=False)) in around


def test_neighbours_take_turns_structural_axis_first_then_a_variant_axis():
    from schedules import stream_wgmma
    from schedules.registry import Schedule

    s = _search()
    o_proj = Problem.make(n=4096, k=4096)
    best = Schedule("stream_wgmma", stream_wgmma.Knobs(64, 1, 2, 64, 6, release_barriers=True, producer_warp=True,
                                                       pdl=True, staged_store=True, early_start=2))
    near = s.neighbours(best, o_proj, H200)
    turns = s._structure_first(best, near)
    assert sorted(turns, key=near.index) == near                      # the same schedules, reordered
    is_variant = [s.without_variants(n) == s.without_variants(best) for n in turns]
    assert 2 <= sum(is_variant) < len(turns) - 1                      # both kinds are there
    assert is_variant[:4] == [False, True, False, True]
    # within each kind the order of `near` stays
    for kind in (False, True):
        mine = [n for n, v in zip(turns, is_variant) if v == kind]
        assert mine == sorted(mine, key=near.index)


def test_refinement_adds_neighbours_of_the_fastest_and_the_winners_beside():
    s = _search()
    meas = _measuring()
    searches = s.plan([(QKV, b) for b in (1, 2, 4)], H200, _spec(), top=3)
    one, two, four = searches
    for x, times in ((one, (9.0, 7.0, 8.0)), (two, (6.0, 9.0, 9.5)), (four, None)):
        for r, us in zip(x.results, times or ()):
            r.us = us
    for r in four.results:                                       # nothing correct there: no round two
        r.error = "wrong: relative error 0.5"
    before = {x.bucket: [r.schedule for r in x.results] for x in searches}
    added = s.add_refinements(searches, H200, _spec(), per_bucket=4)
    assert added == 8 and len(four.results) == 3
    fresh = {x.bucket: [r.schedule for r in x.results[len(before[x.bucket]):]] for x in (one, two)}
    assert all(len(v) == 4 and not set(v) & set(before[b]) for b, v in fresh.items())
    # bucket 1 measures bucket 2's winner (if it is not among its own), then its fastest's neighbours
    if two.winner().schedule not in before[1]:
        assert fresh[1][0] == two.winner().schedule
    best = one.winner().schedule
    assert set(fresh[1]) - {two.winner().schedule} <= set(s.neighbours(best, QKV, H200)) | \
        set(s.neighbours(sorted((r for r in one.results if r.us), key=lambda r: r.us)[1].schedule, QKV, H200))
    assert all(r.us is None and r.error is None for r in one.results[3:])
    assert {job for job in meas.compile_jobs(searches)} == {(QKV, sch) for v in fresh.values() for sch in v}
    assert s.add_refinements(searches, H200, _spec(), per_bucket=0) == 0


def test_refinement_reaches_winners_two_buckets_away_nearest_first():
    # o_proj's M = 4 winner (warps' cp.async slots) also won M = 1 once measured there
    # (docs/performance.md, "Refinement rounds")
    s = _search()
    searches = s.plan([(QKV, b) for b in (1, 2, 4, 8)], H200, _spec(), top=4)
    planned = {r.schedule for x in searches for r in x.results}
    spare = iter(sorted({n for r in searches[0].results for n in s.neighbours(r.schedule, QKV, H200)
                         if n not in planned}, key=lambda n: n.name))
    for x in searches:                      # each bucket's winner: a schedule no other bucket planned
        for i, r in enumerate(x.results):
            r.us = 5.0 + i
        x.results.append(s.Result(next(spare), 1.0, us=1.0))
    winners = [x.winner().schedule for x in searches]
    before = {x.bucket: [r.schedule for r in x.results] for x in searches}
    s.add_refinements(searches, H200, _spec(), per_bucket=6)
    fresh = {x.bucket: [r.schedule for r in x.results[len(before[x.bucket]):]] for x in searches}
    assert fresh[1][:2] == [winners[1], winners[2]]                    # M = 2's, then M = 4's
    assert fresh[2][:3] == [winners[0], winners[2], winners[3]]        # one step away first, then two
    assert fresh[8][:2] == [winners[2], winners[1]]
    # half the places at most for other buckets' winners: the rest are neighbours of the fastest
    assert all(len(v) == 6 and len(set(v) & set(winners)) <= 3 for v in fresh.values())


def test_a_local_round_measures_the_other_layers_winners_at_the_same_m_and_only_where_asked():
    s = _search()
    o_proj, bf16 = Problem.make(n=4096, k=4096), Problem.make(n=4096, k=4096, dtype="bfloat16")
    searches = s.plan([(QKV, 16), (o_proj, 16), (o_proj, 32), (bf16, 16)], H200, _spec(), top=3)
    qkv16, o16, o32, bf16_16 = searches
    planned = {r.schedule for x in searches for r in x.results}
    spare = iter(sorted({n for r in o16.results for n in s.neighbours(r.schedule, o_proj, H200)
                         if n not in planned and n.module.check(QKV, n.knobs, H200) is None
                         and n.module.check(bf16, n.knobs, H200) is None}, key=lambda n: n.name))
    near_qkv16 = set()                      # what qkv16's own neighbours would add anyway
    for x in searches:                      # each bucket's winner: a schedule no other bucket planned
        for i, r in enumerate(x.results):
            r.us = 5.0 + i
        winner = next(w for w in spare if w not in near_qkv16)
        x.results.append(s.Result(winner, 1.0, us=1.0))
        if x is qkv16:
            near_qkv16 = {n for r in (x.results[0], x.results[-1]) for n in s.neighbours(r.schedule, QKV, H200)}
    winners = {id(x): x.winner().schedule for x in searches}
    before = {id(x): len(x.results) for x in searches}
    s.add_refinements(searches, H200, _spec(), per_bucket=3, only=[qkv16, bf16_16])
    fresh = {id(x): [r.schedule for r in x.results[before[id(x)]:]] for x in searches}
    # o_proj's M = 16 winner (same M, group and dtype) right after the buckets beside (none here)
    assert fresh[id(qkv16)][0] == winners[id(o16)]
    assert winners[id(o32)] not in fresh[id(qkv16)]          # another M is not a peer at this rank
    assert winners[id(bf16_16)] not in fresh[id(qkv16)] and winners[id(qkv16)] not in fresh[id(bf16_16)]
    assert not fresh[id(o16)] and not fresh[id(o32)]         # not asked: untouched


def test_round_two_measures_only_the_new_candidates():
    s = _search()
    meas = _measuring()
    x = _bucket(s, 1, ["ok:5", "ok:4"])
    meas.measure_problem(QKV, H200, [x], child_main=fake_child)
    x.results.append(s.Result("ok:3", 1.0))    # a second-round candidate; the parent must not resend the others
    x.results[0].schedule = x.results[1].schedule = "measured already"
    done = []
    meas.measure_problem(QKV, H200, [x], on_bucket=done.append, child_main=fake_child)
    assert [r.us for r in x.results] == [5.0, 4.0, 3.0] and done == [x] and x.winner().us == 3.0


def test_the_harness_reaches_the_measuring_child():
    s = _search()
    meas = _measuring()
    for between, fp16_us in ((False, 10.0), (True, 11.0)):
        x = _bucket(s, 1, ["ok:5"])
        meas.measure_problem(QKV, H200, [x], child_main=fake_child, between=between)
        assert x.fp16_us == fp16_us and x.results[0].us == 5.0


def test_between_times_each_call_after_the_producer_less_the_producers_own_time(monkeypatch):
    import torch

    from gen import timing as measure

    x = torch.ones(3, 8, dtype=torch.float16)
    seen = []
    calls = [lambda: seen.append("gemm")] * 2

    def fake_time_calls(timed, replays):
        seen.clear()
        timed[0]()
        if "gemm" in seen:
            assert len(timed) == 2 and seen == ["gemm"]
            return 9.0
        assert len(timed) == measure.PRODUCER_CALLS
        return 1.5

    monkeypatch.setattr(measure, "time_calls", fake_time_calls)
    assert measure.time_calls_between(calls, x) == 7.5
    assert torch.equal(x, torch.ones(3, 8, dtype=torch.float16))   # rewritten with the same values


def test_compile_failures_become_results(monkeypatch):
    s = _search()
    meas = _measuring()
    searches = s.plan([(QKV, 1), (QKV, 16)], H200, _spec(), top=3)
    broken = searches[0].results[1].schedule
    seen = []

    def fake_compile_many(jobs, arch, workers=None, progress=None):
        seen.extend(jobs)
        return {job: ("nvcc: out of registers" if job[1] == broken else None) for job in jobs}

    monkeypatch.setattr("runtime.kernels.compile_many", fake_compile_many)
    distinct = {r.schedule for x in searches for r in x.results}
    assert len(distinct) < 6                     # the buckets share candidates, compiled once
    assert meas.compile_candidates(searches, H200) == len(distinct) == len(seen)
    for x in searches:
        for r in x.results:
            assert r.error == ("compile: nvcc: out of registers" if r.schedule == broken else None)


def test_winner_and_timings():
    s = _search()
    x = s.BucketSearch(QKV, 16, [s.Result("a", 1.0, us=9.0), s.Result("b", 2.0, us=7.0),
                                 s.Result("c", 3.0, error="wrong: 0.5", rel_err=0.5), s.Result("d", 4.0)])
    assert x.winner().schedule == "b"
    assert s.BucketSearch(QKV, 16, [s.Result("c", 3.0, error="compile: x")]).winner() is None


def test_achieved_gbps():
    s = _search()
    moved = QKV.weight_bytes() + 16 * (QKV.k + QKV.n) * 2
    assert s.achieved_gbps(QKV, 16, 10.0) == pytest.approx(moved / 10e-6 / 1e9)


# --- the measuring-process protocol, with fake children --------------------------------------------
# A fake child reads its "schedules" as instructions: "ok:<us>", "wrong", "crash" (the process dies),
# "hang", "lost" (the CUDA context is gone: report and ask for a restart).

def fake_child(conn, problem, arch_name, tasks, between):
    for bucket, candidates in tasks:
        conn.send(("fp16", bucket, 11.0 if between else 10.0))   # tells the parent which harness it was asked for
        for i, what in candidates:
            conn.send(("start", bucket, i))
            if what.startswith("ok:"):
                conn.send(("result", bucket, i, {"us": float(what[3:]), "rel_err": 1e-4}))
            elif what == "wrong":
                conn.send(("result", bucket, i, {"error": "wrong: relative error 0.5", "rel_err": 0.5}))
            elif what == "crash":
                os._exit(3)
            elif what == "hang":
                time.sleep(600)
            elif what == "lost":
                conn.send(("result", bucket, i, {"error": "crash (CUDA context lost): illegal address"}))
                conn.send(("restart",))
                return
            else:
                raise AssertionError(f"the parent sent {what!r}, which it should have skipped")
    conn.send(("done",))


def fatal_child(conn, problem, arch_name, tasks, between):
    conn.send(("fatal", "RuntimeError: no CUDA device is visible"))


def dying_child(conn, problem, arch_name, tasks, between):
    os._exit(1)


def _bucket(s, bucket, whats):
    return s.BucketSearch(QKV, bucket, [s.Result(w, float(i)) for i, w in enumerate(whats)])


def test_measure_survives_crashes_and_lost_contexts():
    s = _search()
    meas = _measuring()
    first = _bucket(s, 1, ["ok:5", "crash", "ok:3"])
    second = _bucket(s, 16, ["lost", "ok:7", "wrong", "never compiled"])
    second.results[3].error = "compile: boom"
    done, measured = [], []
    meas.measure_problem(QKV, H200, [first, second], progress=measured.append, on_bucket=done.append,
                      child_main=fake_child)

    assert [r.us for r in first.results] == [5.0, None, 3.0]
    assert first.results[1].error == "crashed the measuring process (exit code 3)"
    assert first.winner().us == 3.0 and first.fp16_us == 10.0
    assert second.results[0].error.startswith("crash (CUDA context lost)")
    assert second.results[2].error.startswith("wrong") and second.results[2].rel_err == 0.5
    assert second.results[3].error == "compile: boom"
    assert second.winner().us == 7.0
    assert sorted(d.bucket for d in done) == [1, 16]          # each bucket reported once, when complete
    assert len(measured) == 6


def test_measure_kills_a_hung_candidate():
    s = _search()
    meas = _measuring()
    x = _bucket(s, 1, ["hang", "ok:2"])
    meas.measure_problem(QKV, H200, [x], child_main=fake_child, stall_timeout_s=8)
    assert x.results[0].error.startswith("hung: no progress for 8 s")
    assert x.winner().us == 2.0


def test_measure_reports_a_child_that_cannot_start():
    s = _search()
    meas = _measuring()
    with pytest.raises(meas.MeasureError, match="no CUDA device"):
        meas.measure_problem(QKV, H200, [_bucket(s, 1, ["ok:1"])], child_main=fatal_child)
    with pytest.raises(meas.MeasureError, match="before any candidate finished"):
        meas.measure_problem(QKV, H200, [_bucket(s, 1, ["ok:1"])], child_main=dying_child)


def test_measure_skips_buckets_with_nothing_compiled():
    s = _search()
    meas = _measuring()
    x = _bucket(s, 1, ["never compiled"])
    x.results[0].error = "compile: boom"
    done = []
    meas.measure_problem(QKV, H200, [x], on_bucket=done.append, child_main=dying_child)  # no child needed
    assert done == [x] and x.winner() is None


def test_real_child_without_a_gpu_reports_why():
    import torch

    if torch.cuda.is_available():
        pytest.skip("exercises the measuring process on a machine without CUDA")
    s = _search()
    meas = _measuring()
    small = Problem.make(n=256, k=1024)
    searches = s.plan([(small, 1)], H200, _spec(), top=1)
    with pytest.raises(meas.MeasureError, match="no CUDA device is visible"):
        meas.measure_problem(small, H200, searches)


def test_timings_are_plain_json():
    import json

    s = _search()
    from schedules.marlin_mma import Knobs
    from schedules.registry import Schedule

    r = s.Result(Schedule("marlin_mma", Knobs()), 5.0, rel_err=float("inf"), error="wrong: relative error inf")
    text = json.dumps(r.to_dict(), allow_nan=False)
    assert json.loads(text)["rel_err"] is None and json.loads(text)["schedule"]["family"] == "marlin_mma"


O_PROJ = Problem.make(n=4096, k=4096)


def test_a_problem_is_measured_while_the_next_one_compiles(monkeypatch):
    import threading

    s = _search()
    meas = _measuring()
    searches = s.plan([(QKV, 1), (QKV, 16), (O_PROJ, 1)], H200, _spec(), top=3)
    broken = searches[0].results[0].schedule
    qkv_measuring = threading.Event()
    events = []

    def fake_compile_many(jobs, arch, workers=None, progress=None):
        assert [p for p, _ in jobs] == sorted((p for p, _ in jobs), key=[QKV, O_PROJ].index)  # qkv first
        for job in jobs:
            if job[0] == O_PROJ:      # qkv's kernels are all built: its measuring must be under way
                assert qkv_measuring.wait(10), "qkv was not measured while o_proj compiled"
            events.append(("compiled", job[0]))
            progress(job, "nvcc: out of registers" if job == (QKV, broken) else None)
        return {}

    def fake_measure(problem, arch, mine, progress=None, on_bucket=None, between=False):
        events.append(("measure", problem))
        assert {x.problem for x in mine} == {problem}
        for x in mine:       # the compile errors are on the results before the GPU sees them
            for r in x.results:
                assert (r.error is not None) == (r.schedule == broken and problem == QKV)
                if r.error is None:
                    r.us = 1.0
                    if progress:
                        progress(r)
            on_bucket(x)
        if problem == QKV:
            qkv_measuring.set()

    monkeypatch.setattr("runtime.kernels.compile_many", fake_compile_many)
    compiled, measured, finished = [], [], []
    meas.compile_and_measure(searches, H200, compiled=lambda job, err: compiled.append(job),
                          progress=measured.append, on_bucket=finished.append, measure=fake_measure)
    assert sorted(compiled, key=str) == sorted({(x.problem, r.schedule) for x in searches for r in x.results}, key=str)
    assert len(measured) == sum(len(x.results) for x in searches) - 1
    assert events.index(("measure", QKV)) < events.index(("compiled", O_PROJ))
    assert finished == searches and all(x.winner() for x in searches)
    assert searches[0].results[0].error == "compile: nvcc: out of registers"
    # nothing new to compile: every problem is measured anyway (its buckets are reported finished)
    events.clear()
    finished.clear()
    meas.compile_and_measure(searches, H200, on_bucket=finished.append, measure=fake_measure)
    assert sorted(events, key=str) == sorted([("measure", O_PROJ), ("measure", QKV)], key=str) and len(finished) == 3


def test_a_measuring_failure_is_raised_once_the_compiles_are_done(monkeypatch):
    s = _search()
    meas = _measuring()
    searches = s.plan([(QKV, 1), (O_PROJ, 1)], H200, _spec(), top=2)
    compiled = []

    def fake_compile_many(jobs, arch, workers=None, progress=None):
        for job in jobs:
            progress(job, None)
        return {}

    def no_gpu(problem, arch, mine, progress=None, on_bucket=None, **_):
        raise meas.MeasureError("no CUDA device")

    monkeypatch.setattr("runtime.kernels.compile_many", fake_compile_many)
    with pytest.raises(meas.MeasureError, match="no CUDA"):
        meas.compile_and_measure(searches, H200, compiled=lambda job, err: compiled.append(job), measure=no_gpu)
    assert len(compiled) == len(meas.compile_jobs(searches))


def test_families_far_out_of_reach_are_not_measured():
    from schedules.cost import estimate_us, rank

    s = _search()
    spec = _spec()
    for m, expected in ((1, {"marlin_mma", "stream_mma", "stream_wgmma"}), (4096, {"stream_wgmma", "marlin_mma"})):
        ranked = rank(QKV, m, H200, spec)
        fastest = {}
        for x in ranked:
            fastest.setdefault(x.family, estimate_us(QKV, x, m, spec))
        kept = {f for f, us in fastest.items() if us <= s.FAMILY_CUTOFF * min(fastest.values())}
        planned = {r.schedule.family for r in s.plan([(QKV, m)], H200, spec)[0].results}
        assert planned == kept and kept <= expected
    assert "stream_mma" not in {r.schedule.family for r in s.plan([(QKV, 4096)], H200, spec)[0].results}
    # families named on purpose are all measured
    named = s.plan([(QKV, 4096)], H200, spec, families=["stream_mma", "stream_wgmma"])[0]
    assert {r.schedule.family for r in named.results} == {"stream_mma", "stream_wgmma"}


def _picks(searches):
    return [(s.problem, s.bucket, [(r.schedule, r.estimate_us) for r in s.results]) for s in searches]


def test_plan_in_processes_picks_what_one_process_picks():
    s = _search()
    pairs = [(QKV, 1), (QKV, 64), (Problem.make(n=4096, k=11008), 16)]
    assert _picks(s.plan(pairs, H200, _spec(), top=4, workers=2)) == _picks(s.plan(pairs, H200, _spec(), top=4, workers=1))


def test_plan_workers_rank_the_axes_of_this_process(monkeypatch):
    """`gen tune --axes` changes the families' AXES in the tuning process; the ranking processes
    must rank that space, not the one they import."""
    from schedules import cost, stream_mma

    s = _search()
    monkeypatch.setitem(stream_mma.AXES, "warps", (4,))
    cost._candidates.cache_clear()
    try:
        searches = s.plan([(QKV, 1), (QKV, 2)], H200, _spec(), top=6, families=["stream_mma"], workers=2)
    finally:
        monkeypatch.undo()
        cost._candidates.cache_clear()
    knobs = [r.schedule.knobs for search in searches for r in search.results]
    assert knobs and all(k.warps == 4 for k in knobs)
