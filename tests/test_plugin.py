"""The pytest plugin, run with pytester in subprocesses: what a downstream suite sees."""

from __future__ import annotations

import textwrap

import pytest

SAVE = textwrap.dedent(
    """
    import torch
    from safetensors.torch import load_file, save_file

    def save_and_check(directory):
        tensors = {"w": torch.arange(12.0).reshape(3, 4)}
        save_file(tensors, str(directory / "model.safetensors"))
        assert torch.equal(load_file(str(directory / "model.safetensors"))["w"], tensors["w"])
    """
)


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(helpers=SAVE)
    return pytester


@pytest.mark.slow
def test_stage_fixture_records_and_restores(suite):
    suite.makepyfile(
        test_a=textwrap.dedent(
            """
            import safetensors.torch as st
            from helpers import save_and_check

            ORIGINAL = st.serialize_file

            def test_records(safestage_stage, tmp_path):
                assert st.serialize_file is not ORIGINAL
                save_and_check(tmp_path)
                assert [r.destination.name for r in safestage_stage.records] == ["model.safetensors"]

            def test_restored_after():
                assert st.serialize_file is ORIGINAL
            """
        )
    )
    result = suite.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


@pytest.mark.mounts
def test_hostile_fixtures_fail_plain_and_pass_staged(suite):
    suite.makepyfile(
        test_b=textwrap.dedent(
            """
            import pytest
            from helpers import save_and_check

            @pytest.mark.parametrize("mode", ["hdfs", "eopnotsupp", "objectstore", "mountpoint"])
            def test_plain_fails(safestage_hostile_dir, mode):
                with pytest.raises(Exception, match="os error"):
                    save_and_check(safestage_hostile_dir(mode))

            def test_staged_hdfs(safestage_stage, safestage_hdfs_dir):
                save_and_check(safestage_hdfs_dir)

            def test_staged_mountpoint(safestage_stage, safestage_mountpoint_dir):
                save_and_check(safestage_mountpoint_dir)
                assert safestage_stage.records[0].publish == "direct"

            def test_unknown_mode(safestage_hostile_dir):
                with pytest.raises(ValueError, match="unknown hostile mode"):
                    safestage_hostile_dir("ntfs")
            """
        )
    )
    result = suite.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=7)


@pytest.mark.mounts
def test_real_mount_fixture(suite):
    suite.makepyfile(
        test_r=textwrap.dedent(
            """
            import os
            import pytest
            from helpers import save_and_check

            def test_plain_fails_on_rclone(safestage_real_mount):
                with pytest.raises(Exception, match="os error 1"):  # EPERM: set_len
                    save_and_check(safestage_real_mount("rclone-s3"))

            def test_staged_rclone(safestage_stage, safestage_real_mount):
                directory = safestage_real_mount("rclone-s3")
                save_and_check(directory)
                assert "model.safetensors" in os.listdir(directory)

            def test_plain_s3fs(safestage_real_mount):
                first, second = safestage_real_mount("s3fs"), safestage_real_mount("s3fs")
                assert first != second and first.parent == second.parent  # fresh dirs, one mount
                save_and_check(first)

            def test_unknown_mode(safestage_real_mount):
                with pytest.raises(ValueError, match="unknown real mode"):
                    safestage_real_mount("gcsfuse")
            """
        )
    )
    result = suite.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)


@pytest.mark.mounts
def test_session_option_and_ini(suite, tmp_path):
    suite.makepyfile(
        test_c=textwrap.dedent(
            """
            from helpers import save_and_check

            def test_deep_save(safestage_hdfs_dir):
                save_and_check(safestage_hdfs_dir)  # code we don't own, no fixture for staging
            """
        )
    )
    suite.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(failed=1)
    root = tmp_path / "session-root"
    root.mkdir()
    with_option = suite.runpytest_subprocess("-p", "no:cacheprovider", "--safestage", f"--safestage-dir={root}")
    with_option.assert_outcomes(passed=1)
    with_option.stdout.fnmatch_lines([f"safestage: staging session saves through {root}"])
    suite.makeini(f"[pytest]\nsafestage = true\nsafestage_dir = {root}\n")
    suite.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_bad_session_root_is_a_usage_error(suite, tmp_path):
    suite.makepyfile(test_d="def test_nothing():\n    pass\n")
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", "--safestage", f"--safestage-dir={tmp_path / 'nope'}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--safestage: safestage staging root*does not exist*"])


@pytest.mark.slow
def test_plugin_load_imports_no_torch(suite):
    suite.makepyfile(
        test_e=textwrap.dedent(
            """
            import sys

            def test_no_torch_yet(request):
                assert request.config.pluginmanager.has_plugin("safestage")
                assert "torch" not in sys.modules and "safetensors" not in sys.modules
            """
        )
    )
    suite.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
