"""bench/service_ablation: variant names map to the servers and flags they stand for."""

from bench.service_ablation import cpu_list, server_flags, spec


def test_busy_variant_sets_the_flag_alone_or_joined():
    assert server_flags({"full", "busy2000"}) == ["--busy-poll-us", "2000"]
    assert server_flags({"full", "busy0", "queued"}) == ["--busy-poll-us", "0"]
    assert server_flags({"full", "eager"}) == ["--cuda-graphs", "off"]
    assert server_flags({"full"}) == []


def test_tagged_variant_is_a_second_server_of_the_same_variant():
    first, second = spec("full+busy100", "cpu", None), spec("full+busy100#2", "cpu", None)
    assert second.label == "full+busy100#2"
    assert first.argv == second.argv
    assert second.argv[second.argv.index("--serve") + 1] == "full+busy100"
    assert spec("echo#2", "cpu", None).is_echo


def test_cpu_list_reads_taskset_lists():
    assert cpu_list("2-5,8") == {2, 3, 4, 5, 8}
    assert cpu_list("3") == {3}
    assert spec("full", "cpu", None, cpus={1, 2}).cpus == {1, 2}


def test_variant_pinned_to_its_own_cpus():
    pinned = spec("full+busy100@2-3#2", "cpu", None, cpus={7})
    assert pinned.cpus == {2, 3}
    assert pinned.argv[pinned.argv.index("--serve") + 1] == "full+busy100"
    assert spec("echo@4", "cpu", None).cpus == {4}
