// main() of the multi-GPU tests: builds the world once (multigpu_world.hpp), runs the tests,
// tears the world down collectively, and arms a watchdog that ends a rank whose test stops
// making progress.
#include "multigpu_world.hpp"

#include <cstdio>
#include <cstdlib>

#include "cuda/cuda_backend.hpp"
#include "moe_echo/backends.hpp"

namespace moe_echo::test {
namespace {

std::unique_ptr<MultiGpuWorld> g_world;
std::string g_skip = "not started";

class WorldEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    DistEnv env;
    try {
      env = DistEnv::from_env();
    } catch (const std::exception& e) {
      g_skip = std::string("no multi-process environment: ") + e.what();
      return;
    }
    if (env.world_size < 2) {
      g_skip = "WORLD_SIZE < 2: start with `moe-echo launch -n 2 -- multigpu_test`";
      return;
    }
    const int gpus = cuda::device_count();
    if (gpus < env.world_size) {  // the same answer on every rank of one node
      g_skip = std::to_string(gpus) + " GPUs visible, " + std::to_string(env.world_size) +
               " ranks: need one GPU per rank";
      return;
    }
    auto w = std::make_unique<MultiGpuWorld>();
    w->env = env;
    select_device(env);
    w->be = cuda::make_cuda_backend();
    w->rv = std::make_unique<Rendezvous>(env);
    w->syncfree = make_nccl_communicator(*w->rv);
    NcclOptions base;
    base.dispatcher = Dispatcher::baseline;
    base.all_reduce_staging_bytes = 4096;  // larger all-reduces take the ncclAllReduce path
    base.ctas = 7;                         // an odd grid for the barrier kernels
    w->baseline = make_nccl_communicator(*w->rv, base);
    NcclOptions host = base;
    host.host_api = true;
    w->host_api = make_nccl_communicator(*w->rv, host);
    std::printf("[ world    ] rank %d of %d on GPU %d\n", env.rank, env.world_size, env.local_rank);
    g_world = std::move(w);
  }
  void TearDown() override {
    if (!g_world) return;
    g_world->be->synchronize();
    g_world->rv->barrier();
    g_world->host_api.reset();
    g_world->baseline.reset();
    g_world->syncfree.reset();
    g_world->be.reset();
    g_world->rv.reset();
    g_world.reset();
  }
};

// Kicks the watchdog at every test start and end.
class Progress : public ::testing::EmptyTestEventListener {
 public:
  explicit Progress(Watchdog& w) : w_(w) {}
  void OnTestStart(const ::testing::TestInfo&) override { w_.kick(); }
  void OnTestEnd(const ::testing::TestInfo&) override { w_.kick(); }

 private:
  Watchdog& w_;
};

}  // namespace

MultiGpuWorld* world() { return g_world.get(); }
const std::string& skip_reason() { return g_skip; }

}  // namespace moe_echo::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::AddGlobalTestEnvironment(new moe_echo::test::WorldEnvironment);
  // Twice the communicators' wait timeout (the same variable), so that a wait that gives up
  // reports which op and peer it waited for before the watchdog ends the rank.
  moe_echo::Watchdog watchdog(2 * moe_echo::default_timeout(), "a multi-GPU test");
  ::testing::UnitTest::GetInstance()->listeners().Append(new moe_echo::test::Progress(watchdog));
  return RUN_ALL_TESTS();
}
