// Package fakevllm has stand-ins for vLLM's OpenAI-compatible servers in
// an EPD deployment, for tests and for trying the proxy without a GPU:
//
//   - an encoder (role "encode") answers a chat request that carries one
//     media item as an encode-only vLLM instance does: one token, and
//     ec_transfer_params keyed by the item's identifier, with its modality,
//     placeholder metadata and the transfer_id it was given;
//   - a prefill/decode instance (role "pd") answers chat and completions
//     requests, streaming (SSE, the role chunk first, one chunk per token,
//     [DONE]) or not. It refuses, as a consumer would, an embeds part whose
//     uuid is missing from ec_transfer_params.ec_items, and it answers a
//     prefill request (kv_transfer_params.do_remote_decode) with the KV
//     parameters a decode instance needs.
//
// Every call is recorded. Faults are injected per call (Inject) and health
// is switched by hand. The servers use net/http, as vLLM's uvicorn does, so
// a client that goes away cancels the handler's context; the fake counts
// those.
package fakevllm
