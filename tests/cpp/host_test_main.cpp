// host_test cases: every plugin in each cache format (and the INT32 pool carrier), the library's
// registration entry points, the top-k and sparse-MLA workspace sizes, and main(). Exit status = failures.
#include "host_test.h"
#include "plugin_common.h"

#include <algorithm>
#include <cstdio>

extern "C" nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);
extern "C" bool initDsaTrtPlugins();

using namespace host_test;
using DT = nvinfer1::DataType;

// ---------------------------------------------------------------- cases
namespace
{

constexpr int64_t T = 5, P = 3, B = 2, M = 4, HI = 4, HM = 16, K = 8;
std::vector<DT> const kBytes = {DT::kINT8, DT::kUINT8, DT::kINT32}; // fp8-mode pool carriers

template <class A, class B>
void expectPtr(A a, B b)
{
    EXPECT(static_cast<void const*>(a) == static_cast<void const*>(b));
}

std::vector<Case> cases()
{
    LaunchLog const& L = launches();
    std::vector<Case> cs;
    for (int fmt : {DSA_CACHE_FP8, DSA_CACHE_BF16})
    {
        bool const fp8 = fmt == DSA_CACHE_FP8;
        std::vector<DT> const pool = fp8 ? kBytes : std::vector<DT>{DT::kBF16};
        std::vector<DT> const poolOut = {pool[0]};
        std::string const tag = fp8 ? " fp8" : " bf16";
        double const f = fmt;
        cs.push_back({"DsaMlaCacheWrite" + tag, &dsa_trt::mlaCacheWriteCreator(),
            {{"kv_scale", false, 0.5}, {"cache_format", true, f}},
            {{{DT::kBF16}, dims({T, 512})}, {{DT::kBF16}, dims({T, 64})}, {{DT::kINT64}, dims({T})},
                {pool, dims({P, 64, 576})}},
            {{poolOut, dims({P, 64, 576})}}, 3,
            [&L, fmt](void const* const* in, void* const* out) {
                expectPtr(L.mla.kv_latent, in[0]), expectPtr(L.mla.k_pe, in[1]), expectPtr(L.mla.slot_mapping, in[2]);
                expectPtr(L.mla.pool, out[0]);
                EXPECT(L.mla.num_tokens == T && L.mla.kv_latent_stride == 512 && L.mla.k_pe_stride == 64);
                EXPECT(L.mla.num_slots == P * 64 && L.mla.kv_scale == 0.5F && L.mla.format == fmt);
            },
            [](std::vector<nv::PluginTensorDesc>& in) { in[0].dims.d[1] = 511; }, "kv_latent dim 1 must be 512"});
        cs.push_back({"DsaIndexerKCacheWrite" + tag, &dsa_trt::indexerKCacheWriteCreator(), {{"cache_format", true, f}},
            {{{DT::kBF16}, dims({T, 128})}, {{DT::kINT64}, dims({T})},
                {pool, fp8 ? dims({P, 8448}) : dims({P, 64, 128})}},
            {{poolOut, fp8 ? dims({P, 8448}) : dims({P, 64, 128})}}, 2,
            [&L, fmt](void const* const* in, void* const* out) {
                expectPtr(L.indexerK.index_k, in[0]), expectPtr(L.indexerK.slot_mapping, in[1]);
                expectPtr(L.indexerK.pool, out[0]);
                EXPECT(L.indexerK.num_tokens == T && L.indexerK.index_k_stride == 128);
                EXPECT(L.indexerK.num_slots == P * 64 && L.indexerK.format == fmt);
            },
            [](std::vector<nv::PluginTensorDesc>& in) { in[1].dims.d[0] = T - 1; },
            "slot_mapping dim 0 (4) must equal index_k dim 0 (5)"});
        cs.push_back({"DsaIndexerLogits" + tag, &dsa_trt::indexerLogitsCreator(),
            {{"num_heads", true, double(HI)}, {"cache_format", true, f}},
            {{{fp8 ? DT::kFP8 : DT::kBF16}, dims({T, HI, 128})}, {{DT::kFLOAT}, dims({T, HI})},
                {pool, fp8 ? dims({P, 8448}) : dims({P, 64, 128})}, {{DT::kINT32}, dims({B, M})},
                {{DT::kINT32}, dims({T})}, {{DT::kINT32}, dims({T})}},
            {{{DT::kFLOAT}, dims({T, M * 64})}}, -1,
            [&L, fmt](void const* const* in, void* const* out) {
                expectPtr(L.logits.q, in[0]), expectPtr(L.logits.weights, in[1]), expectPtr(L.logits.pool, in[2]);
                expectPtr(L.logits.page_table, in[3]), expectPtr(L.logits.req_idx, in[4]);
                expectPtr(L.logits.seq_lens, in[5]), expectPtr(L.logits.logits, out[0]);
                EXPECT(L.logits.num_tokens == T && L.logits.num_heads == HI && L.logits.max_pages == M);
                EXPECT(L.logits.logits_stride == M * 64 && L.logits.format == fmt && L.logits.num_requests == B);
            },
            [](std::vector<nv::PluginTensorDesc>& in) { in[0].dims.d[1] = 8; }, "q dim 1 must be 4"});
        cs.push_back({"DsaSparseMla" + tag, &dsa_trt::sparseMlaCreator(),
            {{"num_heads", true, double(HM)}, {"topk", true, double(K)}, {"kv_scale", false, 0.25},
                {"sm_scale", false, 0.125}, {"cache_format", true, f}},
            {{{DT::kBF16}, dims({T, HM, 576})}, {pool, dims({P, 64, 576})}, {{DT::kINT32}, dims({T, K})}},
            {{{DT::kBF16}, dims({T, HM, 512})}, {{DT::kFLOAT}, dims({T, HM})}}, -1,
            [&L, fmt](void const* const* in, void* const* out) {
                expectPtr(L.sparse.q, in[0]), expectPtr(L.sparse.pool, in[1]), expectPtr(L.sparse.slots, in[2]);
                expectPtr(L.sparse.out, out[0]), expectPtr(L.sparse.lse, out[1]);
                EXPECT(L.sparse.num_tokens == T && L.sparse.num_heads == HM && L.sparse.topk == K);
                EXPECT(L.sparse.q_stride_token == HM * 576 && L.sparse.q_stride_head == 576);
                EXPECT(L.sparse.num_slots == P * 64 && L.sparse.kv_scale == 0.25F && L.sparse.sm_scale == 0.125F);
                EXPECT(L.sparse.format == fmt && L.sparse.num_splits == 0 && L.sparse.workspace != nullptr);
            },
            [](std::vector<nv::PluginTensorDesc>& in) { in[2].dims.d[1] = K - 1; }, "slots dim 1 must be 8"});
    }
    cs.push_back({"DsaTopkTranslate", &dsa_trt::topkTranslateCreator(), {{"k", true, double(K)}},
        {{{DT::kFLOAT}, dims({T, M * 64})}, {{DT::kINT32}, dims({T})}, {{DT::kINT32}, dims({B, M})},
            {{DT::kINT32}, dims({T})}},
        {{{DT::kINT32}, dims({T, K})}}, -1,
        [&L](void const* const* in, void* const* out) {
            expectPtr(L.topk.logits, in[0]), expectPtr(L.topk.lengths, in[1]), expectPtr(L.topk.page_table, in[2]);
            expectPtr(L.topk.req_idx, in[3]), expectPtr(L.topk.slots, out[0]);
            EXPECT(L.topk.indices == nullptr && L.topk.rows == T && L.topk.logits_stride == M * 64);
            EXPECT(L.topk.k == K && L.topk.max_pages == M && L.topk.workspace != nullptr);
        },
        [](std::vector<nv::PluginTensorDesc>& in) { in[0].dims.d[1] = M * 64 + 1; },
        "logits width 257 exceeds page_table columns * 64 = 256"});
    // The real-size linear operators (dsa_moe_kernels.h): N = 576 and K = 200 give partial blocks.
    cs.push_back({"DsaFp8BlockLinear", &dsa_trt::fp8BlockLinearCreator(), {{"pow2_scales", true, 1}},
        {{{DT::kBF16}, dims({T, 200})}, {{DT::kFP8}, dims({576, 200})}, {{DT::kFLOAT}, dims({5, 2})}},
        {{{DT::kBF16}, dims({T, 576})}}, -1,
        [&L](void const* const* in, void* const* out) {
            expectPtr(L.linear.x, in[0]), expectPtr(L.linear.weight, in[1]), expectPtr(L.linear.weight_scale, in[2]);
            expectPtr(L.linear.out, out[0]);
            EXPECT(L.linear.num_tokens == T && L.linear.n == 576 && L.linear.k == 200);
            EXPECT(L.linear.x_stride == 200 && L.linear.out_stride == 576 && L.linear.pow2_act_scales == 1);
            EXPECT(L.linear.workspace != nullptr);
        },
        [](std::vector<nv::PluginTensorDesc>& in) { in[2].dims.d[0] = 4; }, "weight_scale dim 0 must be 5"});
    for (int fmt : {DSA_MOE_FP8_BLOCK, DSA_MOE_BF16})
    {
        bool const fp8 = fmt == DSA_MOE_FP8_BLOCK;
        DT const wt = fp8 ? DT::kFP8 : DT::kBF16;
        nv::Dims const s13 = fp8 ? dims({4, 2, 2}) : dims({1});
        nv::Dims const s2 = fp8 ? dims({4, 2, 1}) : dims({1});
        cs.push_back({std::string("DsaMoeExperts") + (fp8 ? " fp8" : " bf16"), &dsa_trt::moeExpertsCreator(),
            {{"num_experts", true, 16}, {"expert_offset", true, 4}, {"weight_format", true, double(fmt)},
                {"pow2_scales", true, 1}},
            {{{DT::kBF16}, dims({T, 256})}, {{DT::kINT32}, dims({T, 3})}, {{DT::kFLOAT}, dims({T, 3})},
                {{wt}, dims({4, 256, 256})}, {{DT::kFLOAT}, s13}, {{wt}, dims({4, 256, 128})}, {{DT::kFLOAT}, s2}},
            {{{DT::kFLOAT}, dims({T, 256})}}, -1,
            [&L, fp8, fmt](void const* const* in, void* const* out) {
                expectPtr(L.moe.x, in[0]), expectPtr(L.moe.topk_ids, in[1]), expectPtr(L.moe.topk_weights, in[2]);
                expectPtr(L.moe.w13, in[3]), expectPtr(L.moe.w2, in[5]), expectPtr(L.moe.out, out[0]);
                expectPtr(L.moe.w13_scale, fp8 ? in[4] : nullptr), expectPtr(L.moe.w2_scale, fp8 ? in[6] : nullptr);
                EXPECT(L.moe.num_tokens == T && L.moe.top_k == 3 && L.moe.num_experts == 16);
                EXPECT(L.moe.num_local_experts == 4 && L.moe.expert_offset == 4 && L.moe.hidden == 256);
                EXPECT(L.moe.inter == 128 && L.moe.weight_format == fmt && L.moe.pow2_act_scales == 1);
                EXPECT(L.moe.workspace != nullptr);
            },
            fp8 ? std::function<void(std::vector<nv::PluginTensorDesc>&)>(
                      [](std::vector<nv::PluginTensorDesc>& in) { in[6].dims.d[2] = 2; })
                : [](std::vector<nv::PluginTensorDesc>& in) { in[4].dims = dims({4, 2, 2}); },
            fp8 ? "w2_scale dim 2 must be 1" : "w13_scale must have rank 1"});
    }
    // The 4-byte carrier of fp8 pools: innermost extent in int32 elements.
    Case mla32 = cs[0];
    mla32.label = "DsaMlaCacheWrite fp8 int32-carrier";
    mla32.inputs[3] = {{DT::kINT32, DT::kINT8, DT::kUINT8}, dims({P, 64, 144})};
    mla32.outputs[0] = {{DT::kINT32}, dims({P, 64, 144})};
    mla32.breakShape = [](std::vector<nv::PluginTensorDesc>& in) { in[3].dims.d[2] = 576; };
    mla32.breakMessage = "pool dim 2 must be 144";
    cs.push_back(mla32);
    return cs;
}

void testRegistration()
{
    gCase = "registration";
    std::vector<std::string> const names = {"DsaFp8BlockLinear", "DsaIndexerKCacheWrite", "DsaIndexerLogits",
        "DsaMlaCacheWrite", "DsaMoeExperts", "DsaSparseMla", "DsaTopkTranslate"};
    std::vector<std::string> keys;
    for (auto const& [key, creator] : registry().creators)
        keys.push_back(key);
    std::vector<std::string> expected;
    for (std::string const& n : names)
        expected.push_back("dsa::" + n);
    EXPECT(keys == expected); // by the static initialiser, at load time
    int32_t n = 0;
    nvinfer1::IPluginCreatorInterface* const* list = getCreators(n);
    EXPECT(n == 7 && registry().creators.empty()); // handed over for loadLibrary
    for (int32_t i = 0; i < n; ++i)                // what loadLibrary then does
        EXPECT(registry().registerCreator(*list[i], "dsa"));
    EXPECT(registry().creators.size() == 7);
    getCreators(n); // the library's own registrations are gone already: nothing to withdraw
    EXPECT(registry().creators.size() == 7);
    for (int32_t i = 0; i < n; ++i)
        registry().deregisterCreator(*list[i]); // deregisterLibrary
    EXPECT(initDsaTrtPlugins() && registry().creators.size() == 7);
    EXPECT(initDsaTrtPlugins() && registry().creators.size() == 7); // idempotent
    EXPECT(logger().messages.empty());
}

// The rules of DsaMoeExperts beyond one shape: the local experts must lie inside the global count,
// the expert count of the fields bounds the offset, and the 2I rows split evenly into gate and up.
void testMoeRules(Case const& moe)
{
    gCase = "DsaMoeExperts rules";
    FieldArg const offset{"expert_offset", true, 16};
    EXPECT(create(moe, true, &offset, 16.0) == nullptr);
    EXPECT_LOGGED("expert_offset=16 must be < num_experts=16");
    FieldArg const late{"expert_offset", true, 13};
    nv::IPluginV3* p = create(moe, true, &late, 13.0);
    EXPECT(p != nullptr);
    auto* rt = static_cast<nv::IPluginV3OneRuntime*>(p->getCapabilityInterface(nv::PluginCapabilityType::kRUNTIME));
    std::vector<nv::PluginTensorDesc> in, out(1);
    for (TensorSpec const& t : moe.inputs)
        in.push_back(nv::PluginTensorDesc{t.dims, t.types[0], nv::TensorFormat::kLINEAR, -1.F});
    out[0] = nv::PluginTensorDesc{moe.outputs[0].dims, DT::kFLOAT, nv::TensorFormat::kLINEAR, -1.F};
    EXPECT(rt->onShapeChange(in.data(), 7, out.data(), 1) != 0);
    EXPECT_LOGGED("expert_offset=13 + 4 local experts (w13 dim 0) exceeds num_experts=16");
    delete p;
    p = create(moe, true);
    rt = static_cast<nv::IPluginV3OneRuntime*>(p->getCapabilityInterface(nv::PluginCapabilityType::kRUNTIME));
    in[3].dims.d[1] = 255;
    EXPECT(rt->onShapeChange(in.data(), 7, out.data(), 1) != 0);
    EXPECT_LOGGED("w13 dim 1 (2I) must be even");
    delete p;
}

} // namespace

int main()
{
    testRegistration();
    for (Case const& c : cases())
    {
        logger().messages.clear();
        gCase = c.label;
        testFields(c);
        testPlugin(c);
        EXPECT(logger().messages.empty());
        logger().messages.clear();
    }
    gCase = "workspace";
    nv::DynamicPluginTensorDesc io[5]{};
    io[0].max = dims({7, 512});
    std::vector<Case> const all = cases();
    testMoeRules(*std::find_if(all.begin(), all.end(), [](Case const& c) { return c.label == "DsaMoeExperts fp8"; }));
    Case const& topkCase
        = *std::find_if(all.begin(), all.end(), [](Case const& c) { return c.label == "DsaTopkTranslate"; });
    nv::IPluginV3* topk = create(topkCase, true); // sized for the profile's max shape
    auto* build = static_cast<nv::IPluginV3OneBuild*>(topk->getCapabilityInterface(nv::PluginCapabilityType::kBUILD));
    EXPECT(build->getWorkspaceSize(io, 4, io + 4, 1) == 1000 + 7 * 512);
    EXPECT(launches().wsRows == 7 && launches().wsMaxLen == 512 && launches().wsK == K);
    delete topk;
    for (int fmt : {DSA_CACHE_FP8, DSA_CACHE_BF16}) // split-KV partials: sized for the profile's max T
    {
        std::string const label = fmt == DSA_CACHE_FP8 ? "DsaSparseMla fp8" : "DsaSparseMla bf16";
        Case const& mlaCase = *std::find_if(all.begin(), all.end(), [&](Case const& c) { return c.label == label; });
        nv::IPluginV3* mla = create(mlaCase, true);
        auto* mlaBuild
            = static_cast<nv::IPluginV3OneBuild*>(mla->getCapabilityInterface(nv::PluginCapabilityType::kBUILD));
        nv::DynamicPluginTensorDesc mlaIo[5]{};
        mlaIo[0].max = dims({9, HM, 576});
        EXPECT(mlaBuild->getWorkspaceSize(mlaIo, 3, mlaIo + 3, 2) == 2000 + 9 * HM);
        EXPECT(launches().wsTokens == 9 && launches().wsHeads == HM && launches().wsTopk == K);
        EXPECT(launches().wsFormat == fmt);
        delete mla;
    }
    for (std::string const label : {"DsaFp8BlockLinear", "DsaMoeExperts fp8", "DsaMoeExperts bf16"})
    {
        gCase = "workspace " + label; // sized for the profile's max T and the weights' extents
        Case const& c = *std::find_if(all.begin(), all.end(), [&](Case const& x) { return x.label == label; });
        nv::IPluginV3* p = create(c, true);
        auto* b = static_cast<nv::IPluginV3OneBuild*>(p->getCapabilityInterface(nv::PluginCapabilityType::kBUILD));
        std::vector<nv::DynamicPluginTensorDesc> io2(c.inputs.size() + 1);
        for (size_t i = 0; i < c.inputs.size(); ++i)
            io2[i].max = c.inputs[i].dims;
        io2[0].max.d[0] = 11;
        int32_t const nbIn = static_cast<int32_t>(c.inputs.size());
        if (label == "DsaFp8BlockLinear")
        {
            EXPECT(b->getWorkspaceSize(io2.data(), nbIn, io2.data() + nbIn, 1) == 3000 + 11 * 576);
            EXPECT(launches().wsLinear[0] == 11 && launches().wsLinear[1] == 576 && launches().wsLinear[2] == 200);
        }
        else
        {
            EXPECT(b->getWorkspaceSize(io2.data(), nbIn, io2.data() + nbIn, 1) == 4000 + 11 * 3);
            int64_t const* w = launches().wsMoe;
            EXPECT(w[0] == 11 && w[1] == 3 && w[2] == 4 && w[3] == 256 && w[4] == 128);
            EXPECT(w[5] == (label == "DsaMoeExperts fp8" ? DSA_MOE_FP8_BLOCK : DSA_MOE_BF16));
        }
        delete p;
    }
    std::printf("%s: %d checks, %d failure(s)\n", gFailures == 0 ? "host_test OK" : "host_test FAILED", gChecks,
        gFailures);
    return gFailures == 0 ? 0 : 1;
}
