#pragma once
// The cost of one securely aggregated round against plain aggregation, without training or a
// network: `clients` updates of `params` float32 values, `dropouts` of them vanishing after
// their masked input, optionally under distributed DP. Used by `pollen bench secagg`.
#include <cstdint>

#include "fed/secagg/options.h"

namespace pollen::fed::secagg {

struct BenchResult {
  // Per client and round, in bytes: what it sends and receives besides the global model.
  uint64_t plain_up = 0;                                      // the float32 update
  uint64_t secure_input_up = 0;                               // the masked update
  uint64_t secure_protocol_up = 0, secure_protocol_down = 0;  // keys, shares, reveal; roster...
  // Seconds per round.
  double plain_client_s = 0;   // encoding one update (float32 copy), mean over clients
  double plain_server_s = 0;   // decoding and the token-weighted mean of all updates
  double secure_client_s = 0;  // keys, shares, quantise and mask, reveal; mean over clients
  double secure_server_s = 0;  // summing inputs, routing, unmasking, dequantising
};

// `dp_clip` > 0: distributed DP, each client clipping its update to the L2 norm dp_clip and
// adding its share of the noise of multiplier `dp_noise` (fed/secagg/private_quantize.h), the
// server dividing by the clients.
BenchResult bench_round(int64_t clients, int64_t params, int64_t dropouts, const Options& options,
                        uint64_t seed, double dp_clip = 0, double dp_noise = 0);

}  // namespace pollen::fed::secagg
