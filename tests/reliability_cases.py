"""The cases of issues 14, 28, 38 and 53 (hardening, rounds one to three, and the user's road) and the tests that show each one's status.

``scripts/reliability_table.py`` turns this list into the table of docs/reliability.md; it
fails when a named test does not exist (``pytest --collect-only``), and with ``--run`` it runs
them and reports each test's outcome. Status: ``fixed`` (every named test asserts the new
behaviour), ``partial`` (what is left is said in the note), ``open`` (not done).
"""

from __future__ import annotations

from typing import NamedTuple


class Case(NamedTuple):
    severity: str
    case: str
    status: str
    tests: tuple[str, ...]
    note: str = ""
    issue: str = "14"


BV, BH, BS, BE = ("tests/test_bridge_vllm_restart.py", "tests/test_bridge_hf.py",
                     "tests/test_bridge_server.py", "tests/test_bridge_edges.py")
CK, VE, FM = "tests/test_checkpoint.py", "tests/test_vllm_engine.py", "tests/test_format.py"
LW = "tests/test_vllm_load_weights.py"
CP, FW, SC, SS = ("tests/test_completeness.py", "tests/test_folder_writer.py", "tests/sglang/test_load_refusals.py",
                  "tests/sglang/test_server.py")
PR = "tests/test_cli_probes.py"

A, WT = "tests/test_bridge_vllm_authority.py", "tests/test_vllm_weight_transfer.py"
OV = "tests/test_bridge_openai_vllm.py"
RD = "tests/test_bridge_vllm_road.py"

CASES: list[Case] = [
    # ---- issue 53 (round four) ----
    Case("high", "data loss by a flag: `quantize --report SRC/model.safetensors` replaced the source model with the Markdown table, "
         "`--report OUT/config.json` the new checkpoint's config; `--report` onto any file overwrote it silently; a folder or an "
         "unwritable path was refused only after 134-489 s of quantizing", "fixed",
         (f"{PR}::test_report_never_overwrites_the_source_model_or_the_new_checkpoint",
          f"{PR}::test_report_refuses_an_existing_file_a_folder_and_an_unwritable_path_before_the_model_loads",
          f"{PR}::test_report_force_replaces_a_layer_report"),
         "`--report` follows `--out`'s rules, checked before the model loads (`cli.prepare_report_destination`): never a path inside "
         "the model folder being read, inside `--out`, or the `--calib` file, even with `--force`; an existing file only with "
         "`--force` and only a layer report written before; a folder or a folder that cannot be written is named; the report is "
         "written whole (a temporary file renamed over it)", "53"),
    Case("high", "a truncating upload killed its reader: apply a 269 MB upload, then `PUT /v1/weights/uploads/SAME?offset=0` with "
         "one byte answered 200 and reopened the file with \"wb\" while the bridge's finiteness check had it mapped (SIGBUS, exit "
         "135) or the engine's worker read it; every stream and the update lost", "fixed",
         (f"{RD}::test_a_truncating_put_during_an_apply_is_refused_and_both_processes_survive",),
         "each upload is written to a private `.NAME.ID.part` file and renamed when it holds the size its safetensors header "
         "declares; a complete upload is never written again, and a new upload of the name, a DELETE or a second apply is 409 "
         "while it is applied (`trainer_bridge/uploads.py`); the test runs the apply and the truncating PUT concurrently against "
         "a real vLLM engine behind `foursight bridge serve`: 409, both processes alive, the engine serving exactly the upload", "53"),
    Case("medium", "two writers on one upload name interleaved (each chunk 200; the applied file half of each, 2.5-3.7 nats "
         "off); a partial upload could be applied", "fixed",
         (f"{RD}::test_one_writer_per_name_and_a_partial_upload_is_never_applied",),
         "offset 0 answers an upload_id that every later chunk must carry; a second writer gets 409 while the first is open; a "
         "partial upload (by name or by the path of its private file) is 422", "53"),
    Case("medium", "no bound on an upload's size (768 MiB into one name in 2 s); never-applied and partial uploads kept forever",
         "fixed", (f"{RD}::test_uploads_are_bounded_and_expire",),
         "--max-upload-bytes (default: the model's BF16 size from its folder plus 16 MiB of headers), checked from "
         "Content-Length and from the declared size; --max-uploads-bytes over all kept uploads; 413 naming the flag; an "
         "upload unwritten or unapplied for --upload-ttl (900 s) is removed", "53"),
    Case("low", "a link planted in the upload folder was followed on write", "fixed",
         (f"{RD}::test_a_planted_link_in_the_upload_folder_is_never_followed",),
         "the folder is opened O_DIRECTORY|O_NOFOLLOW and every open in it is relative to it with O_NOFOLLOW: a planted link "
         "(or a link as the folder) is refused with 409, its target untouched", "53"),
    Case("medium", "a refused apply deleted its upload (409 'another update in progress' in a `finally`), so the trainer's "
         "retry got 422 'not an upload of this bridge'", "fixed",
         (f"{RD}::test_a_refused_apply_keeps_the_upload_so_a_retry_works",
          f"{RD}::test_trls_own_retry_applies_the_upload_after_a_failed_apply"),
         "an upload is removed only after an apply succeeds or by DELETE (or expiry): after a 409 and a 422 it is kept, and "
         "TRL's own client (FourSightVLLMClient, upload=True) retries a 502 through its session and the update lands", "53"),
    Case("high", "any web page could reach the engine's RPCs: a form post (Content-Type text/plain, Origin http://evil.example, "
         "no key) to /collective_rpc got 200; with no key `reset_weights` zeroed the engine and `reload_weights` killed it",
         "fixed",
         (f"{RD}::test_the_engines_dev_routes_need_the_weights_token_json_and_no_foreign_origin",
          "tests/test_bridge_cli.py::test_foursight_serve_mounts_the_dev_route_guard_once"),
         "`foursight serve` mounts `weight_authority.DevRoutesGuard` (vLLM's --middleware; docs/vllm.md gives the flag for "
         "`vllm serve`): /collective_rpc, the weight-transfer routes and the other state-changing dev routes answer 401 without "
         "the weights token (X-FourSight-Weights-Token), 415 for a body that is not JSON, 403 for a foreign Origin; the bridge "
         "sends the token on every engine call", "53"),
    Case("high", "`POST <engine>/collective_rpc {\"method\": \"reload_weights\"}` answered 500 and killed the engine "
         "(EngineDeadError): vLLM's in-place reload met `missing tensor lm_head.weight` (lm_head tied to embed_tokens) with "
         "every layer already on the meta device; the same with a weights_path outside FOURSIGHT_WEIGHTS_DIR", "fixed",
         (f"{RD}::test_reload_weights_with_tied_embeddings_works_and_the_bridge_stops_serving_the_engine",
          f"{RD}::test_reload_weights_from_an_unusable_path_is_refused_before_any_layer_changes"),
         "a tied lm_head is not required of the checkpoint during a reload (`config.checked_complete`); a FourSight model's "
         "reload is checked whole before vLLM touches a layer (`vllm_weight_sync.check_reload`: the tensors the engine "
         "loaded, finite, a complete folder with the served quantization_config, inside the weights folders): refused "
         "naming why, the engine serving the same logprobs; a reload of the checkpoint serves it bit for bit", "53"),
    Case("high", "`reset_weights` through /collective_rpc answered 200 and zeroed every weight while the bridge stayed in_sync "
         "and tagged rollouts of token 0 with the trainer's version (the weights id did not change)", "fixed",
         (f"{RD}::test_reset_weights_makes_the_bridge_stop_serving_the_engine_until_a_good_update",
          f"{WT}::test_bridge_updates_a_vllm_server_through_the_native_api"),
         "every vLLM worker method that changes weights (`vllm_weight_sync.WEIGHT_CHANGING_RPCS`, through /collective_rpc or "
         "/weight_checker) gives the worker a new weights id and the engine core a new weight version (the native route's "
         "state), on both routes: health and "
         "rollouts 503 naming it until an update; reset keeps the layers' channel sets, so the next full update serves "
         "exactly that update", "53"),
    Case("medium", "an update made new requests fail instead of waiting: 200 streams with an update 1.5 s in, 9 answered 503 "
         "('no engine serves the current weights'): `admit()` read the engines' state mid-update", "fixed",
         (f"{RD}::test_new_requests_wait_at_the_gate_during_an_update_and_none_gets_503",),
         "a request reads what the engines serve under the version gate's read lock, so no update starts meanwhile (waiting "
         "for the gate to be idle first still let 3 of 429 requests through 3 updates get 503 on a loaded CI machine); 8 "
         "clients sending back to back through 3 updates all get 200", "53"),
    Case("medium", "a trainer hung against a degraded bridge: FourSightVLLMClient(connection_timeout=60) polled /health (503, "
         "engine stale) 185 times over 8.5 min (TRL's check honours the timeout only on connection errors), so it could "
         "not push the update that repairs the engine", "fixed",
         (f"{RD}::test_trls_client_honours_its_connection_timeout_and_repairs_a_stale_bridge",),
         "the client's check_server waits at most connection_timeout whatever /health answers, then raises ConnectionError "
         "with the last answer; a bridge whose engines are up and only stale is ready at once, and the client's update "
         "repairs it", "53"),
    Case("medium", "a bridge that could never update started anyway (`--weight-sync native` in front of an engine without "
         "--weight-transfer-config: first update 502, then every route 503); (low) a bridge with another weights token "
         "than the engine's started without a word", "fixed",
         (f"{RD}::test_bridge_serve_refuses_an_engine_it_could_never_update",),
         "`bridge serve` checks each vLLM engine at start (`VLLMHTTPEngine.check_updatable`, from /server_info and a guarded "
         "route): exit 2 naming the missing flag (--weight-transfer-config, --worker-extension-cls, VLLM_SERVER_DEV_MODE=1) "
         "or FOURSIGHT_WEIGHTS_TOKEN", "53"),
    Case("low", "the bridge without --api-key served open weight routes without a warning", "fixed",
         ("tests/test_bridge_cli.py::test_a_bridge_without_an_api_key_says_its_routes_are_open",),
         "`bridge serve` warns that every route, weight updates and uploads included, answers anyone who reaches it", "53"),
    Case("low", "a 100,000-deep config.json hit the recursion limit (a traceback)", "fixed",
         (f"{PR}::test_a_config_nested_beyond_the_parser_is_named",),
         "`schema.read_config` (the one reader of config.json) names the file: error, exit 2", "53"),
    Case("low", "checkpoints were written 0700/0600 (tempfile's private modes kept through the rename)", "fixed",
         (f"{PR}::test_written_folders_get_the_users_umask_not_0700",),
         "the one folder writer gives the folder and its files the modes mkdir/open would (the umask) before the rename", "53"),
    # ---- issue 53 (round three, the user's road) ----
    Case("medium", "the OpenAI routes answered 400 where vLLM answers 200: presence_penalty, frequency_penalty, logit_bias, best_of, "
         "response_format, skip_special_tokens, seed -1; and a sample ending on EOS or a stop_token_ids token had that token in its text",
         "fixed",
         (f"{OV}::test_sampling_fields_vllm_takes_are_passed_through", f"{OV}::test_a_field_the_engine_cannot_honour_is_refused_naming_it",
          "tests/test_bridge_openai.py::test_bad_requests_name_the_field",
          "tests/sglang/test_bridge_stream.py::test_sampling_extras_reach_sglang_as_its_own_server_takes_them"),
         "passed to vLLM and SGLang, equal to vLLM's own server through the openai client, each changing the answer; refused with 400 "
         "naming the field and the engine only where it cannot be honoured (best_of > n on vLLM 0.32, the four extras on the HF "
         "engine, an image part)", "53"),
    Case("medium", "chat content parts, an assistant content null, max_tokens with a different max_completion_tokens and a prompt + "
         "max_tokens past the context were 400; chat without max_tokens stopped at 16 tokens (vLLM: the rest of the context)", "fixed",
         (f"{OV}::test_messages_and_budgets_as_vllm_takes_them", f"{BE}::test_openai_route_checks_the_context_too"),
         "content parts joined as vLLM joins them, null as empty; max_completion_tokens first; the default and an over-long "
         "max_tokens are the rest of the context, as vLLM", "53"),
    Case("high", "FourSight's logprobs on SGLang moved 0.07-0.10 nats with the prefix-cache state for the same greedy request (cold, "
         "cached, after /flush_cache); SGLang BF16 did not", "partial",
         ("tests/sglang/test_bridge_stream.py::test_foursight_logprobs_do_not_depend_on_the_prefix_cache",
          "tests/test_layer.py::test_reference_linear_is_batch_invariant"),
         "cause: the CPU linear's float32 product summed in another order for the few rows of a cached prefill; now accumulated "
         "in float64, equal to the last bit. Left: a prompt sharing only part of another's prefix, where SGLang's torch_native "
         "attention (PyTorch's CPU SDPA) differs in the last bit by length (docs/sglang.md)", "53"),
    Case("medium", "through the bridge, SGLang gave no logprobs > 0, no top_logprobs and no echo with logprobs (400), where SGLang's "
         "own server returns them", "fixed",
         ("tests/sglang/test_bridge_stream.py::test_top_and_prompt_logprobs_as_sglangs_own_server",),
         "top_logprobs_num and logprob_start_len 0 on /generate; equal to SGLang's own /v1/completions and chat", "53"),
    Case("medium", "a dead engine cost 22.5 s of connect retries per request before a 502, although /v1/health already reported it "
         "down (about 70 s with the openai client's retries)", "fixed",
         ("tests/sglang/test_bridge_stream.py::test_zz_a_dead_engine_fails_a_request_at_once",),
         "admission asks each engine's health route first (no retries; one read shared by requests that arrive together): 503 naming the engine at once", "53"),
    Case("low", "printed commands that failed or misled: a busy port (the bridge printed its banner and failed after 39 s, foursight "
         "serve a traceback after 46 s); foursight --help imported torch; scripts/reliability_table.py outside the venv printed 94 "
         "false 'missing test' lines; kernels.md's 'the table below' was not there; calibration.md's quantize failed after the "
         "README's main job", "fixed",
         ("tests/test_bridge_cli.py::test_a_busy_port_is_refused_before_anything_starts", "tests/test_cli.py::test_help_answers_without_importing_torch",
          "tests/test_reliability_table.py::test_outside_the_venv_it_says_so_in_one_line",
          "tests/test_bench_splice_gemm_table.py::test_kernels_md_table_is_what_the_printed_command_prints",
          "tests/test_readme_commands.py::test_calibration_md_quantize_follows_the_readme_main_job",
          "tests/test_readme_commands.py::test_calibration_md_commands_run_as_printed_after_the_readme_main_job"),
         "each command run as printed by its test; the port checked before anything starts; the command line's packages import "
         "their parts lazily; the script names the venv in one line; the table is below its command; calibration.md's run is opt-in (FOURSIGHT_TEST_DOCS=1: it quantizes SmolLM2 once more)", "53"),
    Case("low", "the streaming detokenizer was hand-written where tokenizers' installed DecodeStream gives the same text (2.0 against "
         "10.8 us a token)", "fixed", ("tests/test_bridge_openai_stream_text.py::test_the_detokenizer_steps_the_tokenizers_decode_stream",),
         "DecodeStream steps each token; the whole decode only for what it still holds at the end", "53"),
    # ---- issue 38 (round three) ----
    Case("high", "the documented TRL server command bound vLLM to 0.0.0.0 with dev mode: /collective_rpc answered without a key "
         "and loaded any readable safetensors file under the bridge's current version (the bridge stayed in_sync); its answer told "
         "whether a file existed", "fixed",
         (f"{A}::test_documented_engine_binds_loopback_and_refuses_updates_without_the_token", f"{A}::test_bridge_goes_stale_on_weights_it_did_not_push",
          "tests/test_weight_authority.py::test_only_the_token_and_only_the_weights_folder_on_a_served_engine",
          "tests/test_bridge_cli.py::test_foursight_serve_binds_loopback_and_warns_about_dev_routes_off_it"),
         "every documented engine line binds 127.0.0.1 (foursight serve; run as printed); served engines load only with "
         "FOURSIGHT_WEIGHTS_TOKEN from FOURSIGHT_WEIGHTS_DIR, one answer naming no outside path; each push carries a weights id the "
         "engine reports, another id makes it stale; vLLM's own dev-mode methods stayed unguarded in this round (guarded since issue 53: "
         "`weight_authority.DevRoutesGuard`)", "38"),
    Case("high", "vLLM's native route loaded, at finish_weight_update, whatever the file held then (a NaN norm written after the "
         "check was served); a path reused for two buckets loaded the last one twice", "fixed",
         (f"{WT}::test_native_route_loads_the_tensors_it_checked",),
         "update_weights keeps the tensors it checked and finish loads those, bucket by bucket; /collective_rpc reads its file once too", "38"),
    Case("high", "a diverged learner step poisoned or wedged a colocated engine through vLLM's own model.load_weights (a NaN norm, "
         "an Inf embedding row, an online-mode NaN q_proj, an int32 norm)", "fixed",
         (f"{LW}::test_a_diverged_step_is_refused_on_the_trainers_road",),
         "a FourSight model's own load_weights checks each call whole (dtype, shape, finiteness of every tensor, norms and embeddings "
         "included) before writing anything (update_check.guard_load_weights): a TRL tensor or a verl bucket is refused naming the "
         "tensor, logprobs unchanged, the engine answers; SGLang's tensor route likewise (tests/sglang/test_atomic_updates.py)", "38"),
    Case("medium", "a vLLM update the worker refused before loading (wrong shape, int32, unknown name) got 502 and marked the engine "
         "stale: 503 on health and every rollout", "fixed",
         (f"{A}::test_a_refused_vllm_update_is_422_and_the_engine_stays_in_service", f"{WT}::test_bridge_updates_a_vllm_server_through_the_native_api"),
         "the worker's refusal carries 'FourSight refused the weight update, nothing loaded'; the bridge answers 422 naming engine and "
         "tensor, the engine stays in sync and its logprobs are bit-identical, on both vLLM routes", "38"),
    Case("medium", "an abandoned non-streamed OpenAI request kept running in the engine (n = 4, 900 tokens: 4 requests still running "
         "6 s after the client left, and an update got 409)", "fixed",
         (f"{OV}::test_a_client_that_leaves_cancels_its_engine_requests",),
         "the OpenAI routes cancel their engine requests when the client disconnects, streamed or not: vLLM's running count reaches 0, "
         "the bridge holds no stream, and vLLM generated under 90 % of the requested tokens (the client leaves after 0.2 s; at 1 s a "
         "warm engine had finished all of them first, so the earlier check passed without a cancellation; its 4 s bound failed once "
         "under a loaded CI, 2026-12-07, and is 20 s now, the time printed)", "38"),
    Case("medium", "`foursight rl --resume` unpickled whatever checkpoint it was given (torch.load(weights_only=False))", "fixed",
         ("tests/test_rl.py::test_resume_refuses_a_checkpoint_that_would_run_code",),
         "checkpoints load with weights_only=True; a file that is not one is refused by name before any of it runs", "38"),
    Case("medium", "`--force --out FOLDER/sub/..` emptied FOLDER and wrote nothing (the temporary folder went into the unresolved "
         "parent, inside the folder being replaced)", "fixed",
         (f"{FW}::test_out_through_dotdot_replaces_the_folder_it_names",),
         "`--out` is resolved before anything else (`folder_writer.resolve_out`); the temporary folder `<out>.tmp-XXXXXXXX` goes "
         "beside the resolved target", "38"),
    Case("low", "`--force` on a folder FourSight made deleted files the user had added to it", "fixed",
         (f"{FW}::test_force_refuses_a_folder_of_ours_holding_the_users_files_naming_them", f"{CK}::test_force_replaces_only_a_foursight_checkpoint"),
         "`.foursight-written` lists the files the writer wrote; `--force` refuses a folder holding anything else, naming it, and "
         "deletes nothing", "38"),
    Case("low", "a stray `.foursight-incomplete` marker made a user's folder removable without `--force`", "fixed",
         (f"{FW}::test_a_stray_marker_does_not_make_a_folder_ours",),
         "the marker plays no part in ownership: a marked destination is removed only if `.foursight-written` makes it ours and it "
         "holds nothing else", "38"),
    Case("low", "a second run to the same `--out` deleted a live run's temporary folder", "fixed",
         (f"{FW}::test_a_second_run_leaves_a_live_runs_temporary_folder_alone",),
         "a live run holds an flock on its marker until it ends; a later run removes only temporary folders whose lock is free "
         "(their run died)", "38"),
    Case("low", "`--out` with glob characters was used as a glob (it removed the temporary folder of another destination)", "fixed",
         (f"{FW}::test_out_with_glob_characters_is_a_plain_name",),
         "temporary folders are matched by literal name prefix plus mkdtemp's 8-character suffix, never a pattern", "38"),
    Case("low", "`calibrate --out` overwrote any existing file", "fixed",
         (f"{PR}::test_calibrate_refuses_an_existing_file_without_force", f"{PR}::test_calibrate_force_replaces_a_channels_file"),
         "an existing file is refused without `--force`; with it only a file `ChannelsFile.read` accepts is replaced "
         "(`checkpoint.prepare_channels_destination`)", "38"),
    # ---- issue 28 (round two) ----
    Case("high", "vLLM and SGLang serve a FourSight checkpoint without a norm tensor and report healthy (without "
         "`model.norm.weight` vLLM answers `'ikipedia\\n\\n,,,,…'`); a compressed-tensors folder missing a norm passes "
         "`inspect` and is imported", "fixed",
         (f"{CP}::test_vllm_refuses_to_serve_a_bad_checkpoint_naming_the_tensor",
          f"{SC}::test_sglang_refuses_a_checkpoint_without_its_norm_at_load_naming_it",
          f"{CP}::test_incomplete_compressed_tensors_folder_is_refused_by_inspect_and_import",
          f"{CP}::test_incomplete_foursight_folder_is_refused_by_inspect"),
         "every reader compares the tensors with the model: inspect/import with the model config.json describes "
         "(`compressed_tensors_format.check_complete_tensors`), vLLM and SGLang with the model's parameters after the fused-layer mapping "
         "(`quant_methods/config.checked_complete`), transformers with the instantiated state dict; tied weights may be "
         "absent; a missing or stray tensor is named", "28"),
    Case("high", "a global scale of 1e-40 is \"valid\" at `inspect`, then kills vLLM at its first request; zero and "
         "overflow", "fixed",
         (f"{CP}::test_global_scale_out_of_range_is_refused_by_inspect_naming_it",
          f"{CP}::test_the_scale_range_is_where_the_dequantized_weight_is_finite",
          f"{CP}::test_vllm_refuses_to_serve_a_bad_checkpoint_naming_the_tensor",
          f"{SC}::test_the_layer_check_refuses_a_subnormal_global_scale_naming_it"),
         "weight and input global scales must lie in [448·6/max(BF16) ≈ 7.9e-36, max(float32)]: zero, negative, "
         "subnormal, NaN/Inf and scales whose 448·6/scale overflows BF16 are refused naming the tensor "
         "(`schema.check_global_scale`, in the one codec every reader uses)", "28"),
    Case("high", "weight updates not atomic on every route (vLLM native route applies tensors before a refused one; "
         "rejected tensors served later; NaN accepted; HF takes int32)", "fixed",
         (f"{LW}::test_a_refused_update_changes_nothing_and_is_never_served_later",
          f"{LW}::test_a_bad_tensor_is_refused_naming_it",
          "tests/sglang/test_atomic_updates.py::test_a_refused_update_from_tensor_changes_nothing_and_is_never_served_later",
          "tests/sglang/test_atomic_updates.py::test_a_refused_update_from_disk_through_the_bridge_changes_nothing",
          "tests/test_hf_update_refusals.py::test_an_int32_update_through_the_bridge_is_refused_naming_it_and_changes_nothing"),
         "vLLM, in memory (`apply_weight_update`), native (`foursight_file`: each file checked on arrival, loaded only at "
         "`finish_weight_update`) and `/collective_rpc`: the whole update (names, float dtypes, shapes, finiteness) is "
         "checked before anything loads (`vllm_weight_update.check_update`); a bad shape, NaN, int32 or unknown name as the "
         "last tensor leaves the logprobs bit-identical and the version unchanged, and the next good update equals a fresh "
         "load. SGLang (`update_weights_from_tensor`, flattened buckets, `update_weights_from_distributed`, "
         "`update_weights_from_disk` and the bridge's route to it): the plugin checks the whole update the same way "
         "(`quant_methods/update_check.check_update`, checkpoint tensors included) before SGLang writes anything; a NaN, "
         "int32, wrong shape or unknown name after good tensors is refused naming it, logprobs bit-identical, weight_version "
         "unchanged, and a later valid update gives exactly its own logprobs. The HF engine refuses an int32 update through "
         "the bridge's HTTP route naming the tensor, every parameter bit-identical; an update an engine refuses before "
         "applying any of it (HF, or SGLang with the plugin) gets 422 from the bridge, not 502", "28"),
    Case("high", "`--weight-sync native`: a restarted vLLM is not noticed", "fixed",
         (f"{BV}::test_engine_restart_is_detected_on_the_native_sync_route",),
         "on the native route the engine's version is read from vLLM's `GET /weight_info` (the version the bridge gave "
         "`/finish_weight_update`; vLLM starts at \"default\", read as 0, and returns to it on a restart): health 503 "
         "stale and rollouts refused until a re-push", "28"),
    Case("medium", "a killed `import` or `export` leaves an unmarked half-written folder `inspect` calls valid; "
         "`import --force` / `export --force` delete any folder", "fixed",
         (f"{FW}::test_killed_writer_leaves_a_marked_folder_every_reader_refuses_and_a_rerun_removes",
          f"{FW}::test_force_refuses_to_replace_a_folder_that_is_not_ours",
          f"{FW}::test_force_replaces_what_the_same_verb_wrote",
          f"{FW}::test_a_marked_destination_is_refused_by_readers_and_removed_by_the_next_run",
          f"{CP}::test_vllm_refuses_to_serve_a_bad_checkpoint_naming_the_tensor"),
         "one folder writer (`folder_writer.folder_writer`) for quantize, import and export: a temporary folder under "
         "the `.foursight-incomplete` marker, renamed at the end, the marker cleared last; every reader (inspect, "
         "import, export, transformers, vLLM, SGLang) refuses a marked folder naming the marker; the next run removes it; "
         "`--force` replaces only a FourSight checkpoint or a folder a FourSight writer made (`.foursight-written`)", "28"),
    Case("medium", "HF engine: a prompt longer than the model's context is not checked (a 12k-token prompt blocked it "
         "for 83 s)", "fixed",
         (f"{BE}::test_prompt_beyond_the_hf_models_context_is_422_naming_the_field",
          f"{BE}::test_openai_route_checks_the_context_too",
          "tests/test_bridge_vllm.py::test_prompt_beyond_the_vllm_context_is_422_naming_the_field",
          f"{SS}::test_bridge_refuses_a_prompt_beyond_the_sglang_context_naming_the_field"),
         "prompt tokens + max_tokens must fit the served context (HF: `max_position_embeddings`; vLLM/SGLang: "
         "`max_model_len` of their `GET /v1/models`): 422 naming `prompts[i]`, `prompts[i].max_tokens` or "
         "`sampling.max_tokens`, before any generation (the OpenAI routes: 400 in OpenAI's error shape, as vLLM answers)", "28"),
    Case("medium", "a client that opens a large stream and never reads blocks every weight update (409) for as long "
         "as it holds the connection", "fixed",
         (f"{BE}::test_a_stream_whose_client_stops_reading_is_dropped_and_cannot_block_updates",),
         "each response write may wait 30 s (`create_app(write_timeout_s=)`, `guards.DEFAULT_WRITE_TIMEOUT_S`) for the "
         "client to read; then the stream is dropped, its engine calls cancelled and its hold on updates released "
         "(counted as `errors{kind=\"write_timeout\"}`)", "28"),
    Case("medium", "transformers `from_pretrained` loads NaN-norm and Inf-embedding checkpoints (non-finite logits)", "fixed",
         (f"{CP}::test_transformers_from_pretrained_refuses_bad_values_naming_the_tensor",
          f"{CP}::test_transformers_from_pretrained_names_a_truncated_file"),
         "the quantizer checks every tensor of the loaded model and names it", "28"),
    Case("low", "vLLM dies on a truncated safetensors file with a raw traceback that does not name the file", "fixed",
         (f"{CP}::test_vllm_refuses_to_serve_a_bad_checkpoint_naming_the_tensor",),
         "the folder's safetensors headers are opened before vLLM reads them (`tensor_io.check_headers`)", "28"),
    Case("low", "a body with invalid UTF-8 gets 400 in FastAPI's shape instead of the documented 422", "fixed",
         (f"{BE}::test_body_with_invalid_utf8_gets_the_documented_422",),
         "422 naming `body`, in the bridge's shape or, on the OpenAI routes, the OpenAI one", "28"),
    Case("low", "probing 19 bridge requests: a body that is not JSON named field `[1]`; OpenAI routes answered a "
         "validation error in the bridge's shape; an update the engine refused before applying it was a 502", "fixed",
         (f"{BE}::test_a_body_that_is_not_json_is_named_body", "tests/test_bridge_hf.py::test_bad_weight_update_names_the_tensor"),
         "`body` named; every 422 of an OpenAI route in the OpenAI shape (`guards.invalid_request`); an engine's "
         "refusal before applying anything is a 422 naming engine and tensor (`backends.base.UpdateRefused`). The other "
         "16 probes (missing/ill-typed fields, n <= 0, huge max_tokens, out-of-vocabulary ids, bad sampling values, "
         "non-safetensors weight files) already gave a 422 naming the field", "28"),
    Case("high", "probing 28 CLI runs: `models tiny --out` overwrote any existing folder (a FourSight checkpoint here); "
         "reading its code then showed `models prepare --out X --force` deleting whatever folder X named", "fixed",
         (f"{PR}::test_models_tiny_refuses_an_existing_folder_and_force_replaces_only_its_own",
          f"{PR}::test_models_prepare_force_does_not_delete_a_folder_it_did_not_write"),
         "both write through the one folder writer (`folder_writer.folder_writer`): an existing folder is refused, "
         "and `--force` replaces only a folder a FourSight writer made", "28"),
    Case("low", "probing 28 CLI runs: eleven unclear answers. `--channels 200%`/`abc`, `--max-length 0` and an "
         "unwritable `rl --out` were reported only after the model loaded (`--max-length 0` as a reshape error inside "
         "attention); a missing `--calib` or `--prompts` file as a bare errno; `calibrate --out <folder>` as a traceback "
         "leaving `<folder>.tmp`; `compare` ignored `--engine-url` for the in-process hf engine and a `--foursight-ckpt` "
         "it does not use (and, found while fixing these, an `--engine-url` for an engine it does not run and a given "
         "checkpoint not of its kind); "
         "`bridge serve --engine hf --model <missing>` gave a transformers traceback; `import` of a BF16 folder said "
         "`quant_method is None`", "fixed",
         (f"{PR}::test_a_bad_channels_value_is_named_before_the_model_loads",
          f"{PR}::test_quantize_max_length_zero_is_named",
          f"{PR}::test_a_missing_calibration_file_names_the_flag",
          f"{PR}::test_calibrate_out_a_folder_is_refused_and_leaves_nothing",
          f"{PR}::test_rl_out_that_cannot_be_written_is_named_before_the_model_loads",
          f"{PR}::test_rl_bad_channels_is_named",
          f"{PR}::test_compare_refuses_a_url_for_the_in_process_hf_engine",
          f"{PR}::test_compare_refuses_a_url_for_an_engine_it_does_not_run",
          f"{PR}::test_compare_names_a_missing_prompts_file_before_quantizing",
          f"{PR}::test_compare_checks_the_checkpoints_it_is_given",
          f"{PR}::test_bridge_hf_model_that_does_not_exist_is_named",
          f"{PR}::test_import_of_a_bf16_folder_says_what_it_is"),
         "each gets `error:` naming the flag or folder, exit status 2, before any model loads (the tests fail if one "
         "does). The other 15 runs (unknown arch, precision, task or filter, `--out` equal to `--model`, a file as a "
         "checkpoint, a k > 0 export, a missing `--engine-url`, a non-loopback `--host`, a missing `--weights-dir`, "
         "a missing `serve` model) were already clear", "28"),
    Case("low", "`foursight rl` left a `/tmp/foursight-rl-*` folder per run, with the vLLM engine's quantized "
         "checkpoint in it (model-sized)", "fixed",
         ("tests/test_rl.py::test_run_rl_hf_tiny_end_to_end", "tests/test_rl.py::test_run_rl_vllm_cpu_smoke"),
         "the vLLM rollout engine owns a temporary folder and removes it on close; `run_rl` closes the engine however "
         "the run ends", "28"),
    # ---- issue 14 (round one) ----
    Case("high", "vLLM killed and restarted after an update: samples tagged with the pushed version while the engine "
         "serves its checkpoint; health ok", "fixed",
         (f"{BV}::test_engine_restart_after_an_update_is_detected_and_refused",
          f"{BS}::test_engine_restart_mid_stream_gives_error_events_not_mistagged_samples",
          f"{BH}::test_hf_engine_reload_is_detected_and_rollouts_refused_until_an_update"),
         "the engine reports boot id + version (worker extension RPC `foursight_engine_state`); a stale engine gets no "
         "samples, rollouts answer 503 naming it, health 503; a new update brings it back (no automatic re-push)"),
    Case("high", "checkpoint with NaN fp8 `weight_scale` or Inf `embed_tokens` row passes inspect and loads in vLLM", "fixed",
         (f"{CK}::test_inspect_rejects_non_finite_tensor_naming_it",
          f"{VE}::test_non_finite_checkpoint_refuses_to_load_in_vllm_naming_the_tensor")),
    Case("high", "HF engine: one huge `max_tokens` + `ignore_eos` request blocks every client; the per-sample timeout "
         "does not stop it; health ok", "fixed",
         (f"{BH}::test_short_request_is_not_starved_by_a_long_one",
          f"{BH}::test_interleaved_samples_are_identical_to_alone",
          f"{BH}::test_sample_timeout_stops_the_hf_generation",
          f"{BH}::test_health_fails_while_the_hf_engine_cannot_complete_a_request",
          f"{BE}::test_fields_checked_against_the_served_model_name_the_field",
          f"{BE}::test_per_request_token_budget_names_the_field",
          f"{BH}::test_requests_share_the_hf_engine_equally_whatever_their_sample_count"),
         "the HF engine serves its samples round-robin (4 tokens a turn, a KV cache and a seeded generator per sample): "
         "a 1-token request finishes while a 1000-token one runs, results bit-identical to running alone; timeout and "
         "disconnect drop the sample; health's probe fails only when the model cannot complete a forward; "
         "`--max-tokens-cap` bounds a sample and `--max-request-tokens` a request (n x the prompts' max_tokens). Fair "
         "across requests, then samples: a request of 6 samples gets the turns of a request of 1"),
    Case("medium", "weight update with NaN in `model.norm.weight` accepted by vLLM, version bumped", "fixed",
         (f"{BV}::test_engine_restart_after_an_update_is_detected_and_refused",
          f"{BH}::test_non_finite_update_is_rejected_and_previous_weights_keep_serving",
          f"{VE}::test_non_finite_update_is_rejected_by_the_worker_and_previous_weights_keep_serving"),
         "the bridge checks a local file before any engine sees it; the vLLM worker checks it itself"),
    Case("medium", "BF16 HF engine accepts a NaN tensor in an update", "fixed",
         (f"{BH}::test_hf_engine_rejects_non_finite_norm_without_applying_anything",)),
    Case("medium", "update `path` confined to no folder (`/etc/passwd`, `../`, other models); 422 vs 502 tells "
         "whether a file exists", "fixed",
         (f"{BE}::test_update_path_outside_weights_dir_gets_one_answer_for_every_reason",
          f"{BE}::test_shm_name_cannot_leave_the_shm_folder"),
         "confined with `--weights-dir` (repeatable); without it any readable path is allowed and the CLI warns"),
    Case("medium", "`Host`/`Origin` not checked (DNS rebinding drives a loopback bridge)", "fixed",
         (f"{BE}::test_host_and_origin_are_checked_against_dns_rebinding", f"{BE}::test_operator_allowed_host_passes")),
    Case("medium", "no body size limit; body parsed before the API key is checked", "fixed",
         (f"{BE}::test_body_over_the_limit_is_413_before_parsing", f"{BE}::test_api_key_is_checked_before_the_body_is_parsed")),
    Case("medium", "HF engine: client disconnect or per-sample timeout does not stop the generation", "fixed",
         (f"{BH}::test_client_disconnect_stops_the_hf_generation_and_metrics_stay_true",
          f"{BH}::test_sample_timeout_stops_the_hf_generation")),
    Case("medium", "checkpoint with NaN in `model.norm.weight` reported valid; vLLM serves it", "fixed",
         (f"{CK}::test_inspect_rejects_non_finite_tensor_naming_it",
          f"{VE}::test_non_finite_checkpoint_refuses_to_load_in_vllm_naming_the_tensor")),
    Case("low", "`active_streams` stays raised after disconnects; the disconnect counter never counts", "fixed",
         (f"{BH}::test_client_disconnect_stops_the_hf_generation_and_metrics_stay_true",)),
    Case("low", "`min_tokens > max_tokens`, ids outside the vocabulary, ids/seeds beyond int64: per-sample engine "
         "errors instead of a 422 naming the field", "fixed",
         (f"{BE}::test_fields_checked_against_the_served_model_name_the_field", f"{BE}::test_ids_at_the_vocabulary_edge_are_accepted"),
         "the vocabulary is the HF model's, or `vocab_size` of the `--tokenizer` folder's config.json for vLLM/SGLang"),
    Case("low", "(found here) a `request_id` with CR/LF: the response was cut (invalid X-Request-Id header)", "fixed",
         (f"{BE}::test_fields_checked_against_the_served_model_name_the_field",), "printable ASCII only: 422 naming `request_id`"),
    Case("low", "nonexistent update path: 502 on vLLM, 422 on HF", "fixed",
         (f"{BE}::test_update_path_outside_weights_dir_gets_one_answer_for_every_reason",
          f"{BV}::test_engine_restart_after_an_update_is_detected_and_refused"),
         "the bridge resolves the path before any engine sees it: one 422 on every engine kind"),
    Case("low", "truncated safetensors file: raw traceback without the file name", "fixed",
         (f"{CK}::test_truncated_safetensors_names_the_file",)),
    Case("low", "`foursight quantize --force` deletes any existing `--out`", "fixed",
         (f"{CK}::test_force_replaces_only_a_foursight_checkpoint",)),
    Case("low", "a killed `quantize` leaves its temporary folder, and `inspect` calls it valid", "fixed",
         (f"{CK}::test_killed_quantize_leaves_a_folder_every_reader_refuses_and_the_next_run_removes",),
         "a SIGKILLed run cannot clean up: its folder holds a marker every reader refuses, and the next run removes it"),
    Case("low", "channels-file reader accepts NaN `input_amax` and non-integer indices; non-numeric gives a bare ValueError", "fixed",
         (f"{FM}::test_channels_file_rules",)),
    Case("low", "server guards (loopback unless `--allow-remote` with a key) only in the CLI", "fixed",
         (f"{BE}::test_serve_itself_refuses_remote_binds_without_a_key", "tests/test_bridge_cli.py::test_serve_rejects_bad_options")),
    Case("build", "SGLang: non-finite checkpoint tensors at load and in its own update path", "fixed",
         (f"{SC}::test_the_loader_check_refuses_a_non_finite_tensor_naming_it",
          "tests/sglang/test_server.py::test_non_finite_update_from_disk_is_refused_and_previous_weights_keep_serving"),
         "the plugin checks every tensor SGLang's weight iterator yields, and a local folder whole before any weight "
         "is written (SGLang's own rollback re-reads the new path); run in .venv-sglang"),
    Case("build", "SGLang engine restart detection", "fixed",
         ("tests/sglang/test_server.py::test_bridge_engine_reads_the_version_sglang_serves",
          "tests/sglang/test_server.py::test_bridge_detects_a_restarted_sglang_server_and_refuses_its_rollouts"),
         "through the weight_version the bridge sends and reads back (/get_model_info); SGLang has no boot id, so a "
         "restart is seen as the version falling back to 0: a real SGLang server restarted behind the bridge after "
         "version 7 gives health 503 (stale) and refused rollouts, serves its original checkpoint (measured against "
         "both references), and is in sync after the re-push"),
    Case("build", "engine killed mid-stream: error events, nothing lost; 100 concurrent streams", "fixed",
         ("tests/test_bridge_vllm.py::test_zz_engine_killed_mid_stream", "tests/test_bridge_vllm.py::test_hundred_concurrent_streams"),
         "kept passing (the load test runs 100 concurrent streams against the real vLLM CPU engine)"),
]
