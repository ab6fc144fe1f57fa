"""STAND-IN for tensorrt_llm.llmapi: only the multi-node launcher's two entry points (mgmn_leader_node,
mgmn_worker_node), which trtllm-llmapi-launch runs."""
