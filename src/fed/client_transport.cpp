// The server's handling of the pull and push streams, shared by the gRPC service and the
// in-process transport, and that transport (`pollen fed simulate`).
#include "fed/client.h"

namespace pollen::fed {

void serve_pull(Coordinator& c, const pb::PullRequest& r, const std::string& peer_id,
                const std::function<void(const pb::TensorStream&)>& write) {
  const auto model = c.pull(r, peer_id);
  pb::TensorStream msg;
  *msg.mutable_header() = model->header;
  write(msg);
  for_each_chunk(model->bytes, kMaxChunkBytes, [&](const pb::Chunk& chunk) {
    *msg.mutable_chunk() = chunk;
    write(msg);
  });
}

pb::PushReply serve_push(Coordinator& c, const std::string& peer_id,
                         const std::function<bool(pb::TensorStream&)>& read) {
  pb::TensorStream first, second;
  POLLEN_CHECK(read(first) && first.has_update(), "push: the stream must open with update info");
  POLLEN_CHECK(read(second) && second.has_header(),
               "push: the update info must be followed by a tensor header");
  auto push = c.push_begin(first.update(), second.header(), peer_id);
  pb::TensorStream msg;
  while (read(msg)) {
    POLLEN_CHECK(msg.has_chunk(), "push: after the header only chunks may follow");
    c.check_push_open(push);
    push.chunks->add(msg.chunk());
  }
  return c.push_finish(push);
}

void LocalTransport::pull(const pb::PullRequest& r,
                          const std::function<void(const pb::TensorStream&)>& on_message) {
  // Through bytes, as over the network: what the client parses is what a peer would send.
  serve_pull(c_, r, "", [&](const pb::TensorStream& m) {
    pb::TensorStream copy;
    POLLEN_CHECK(copy.ParseFromString(m.SerializeAsString()), "pull: unparsable message");
    on_message(copy);
  });
}

pb::PushReply LocalTransport::push(const std::function<bool(pb::TensorStream&)>& next) {
  return serve_push(c_, "", [&](pb::TensorStream& m) {
    pb::TensorStream out;
    if (!next(out)) return false;
    POLLEN_CHECK(m.ParseFromString(out.SerializeAsString()), "push: unparsable message");
    return true;
  });
}

pb::SecAggReply LocalTransport::secagg(const pb::SecAggRequest& r) {
  pb::SecAggRequest request;
  POLLEN_CHECK(request.ParseFromString(r.SerializeAsString()), "secagg: unparsable message");
  pb::SecAggReply reply;
  POLLEN_CHECK(reply.ParseFromString(c_.secagg(request, "").SerializeAsString()),
               "secagg: unparsable reply");
  return reply;
}

}  // namespace pollen::fed
