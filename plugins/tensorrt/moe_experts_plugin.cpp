// DsaMoeExperts: out[t] = sum over t's top-k pairs whose expert e lies on this rank
// ([expert_offset, expert_offset + E_local)) of topk_weights[t, j] * down_e(act_quant(silu(gate_e(x_t)) * up_e(x_t)))
// in fp32; other ranks' pairs add nothing (expert-parallel ranks sum their outputs). weight_format
// 0: e4m3 experts with 128x128 fp32 scales (W8A8 as DsaFp8BlockLinear); 1: bf16 experts, whose
// scale inputs are FLOAT [1] placeholders (ONNX plugin nodes have no optional inputs). Expert ids
// are device data: out-of-range ids cannot be checked here without a sync; the kernel skips them.
// Semantics: plugins/fp8_reference.py moe_experts; kernel: dsa_launch_moe_experts (dsa_moe_kernels.h).
#include "plugin_common.h"

namespace dsa_trt
{
namespace
{

constexpr int32_t kMaxExperts = 1 << 16;

class MoeExpertsPlugin : public PluginBase<MoeExpertsPlugin>
{
public:
    enum Input : int32_t
    {
        kX = 0,           // [T, D] bf16
        kTopkIds = 1,     // [T, k] int32 global expert ids
        kTopkWeights = 2, // [T, k] fp32 combine weights
        kW13 = 3,         // [E, 2I, D] e4m3 | bf16: gate rows [0, I), up rows [I, 2I)
        kW13Scale = 4,    // [E, ceil(2I/128), ceil(D/128)] fp32 | [1] placeholder
        kW2 = 5,          // [E, D, I] e4m3 | bf16
        kW2Scale = 6,     // [E, ceil(D/128), ceil(I/128)] fp32 | [1] placeholder
    };
    enum Output : int32_t
    {
        kOut = 0, // [T, D] fp32
    };

    static constexpr char kName[] = "DsaMoeExperts";
    static constexpr FieldSpec kFields[] = {
        {"num_experts", FieldKind::kInt},
        {"expert_offset", FieldKind::kInt},
        {"weight_format", FieldKind::kInt},
        {"pow2_scales", FieldKind::kInt},
    };
    static constexpr int32_t kNbInputs = 7;
    static constexpr int32_t kNbOutputs = 1;

    explicit MoeExpertsPlugin(FieldValues const& f)
        : mNumExperts(f.intInRange("num_experts", 1, kMaxExperts))
        , mExpertOffset(f.intInRange("expert_offset", 0, kMaxExperts - 1))
        , mWeightFormat(f.intInRange("weight_format", DSA_MOE_FP8_BLOCK, DSA_MOE_BF16))
        , mPow2Scales(f.intInRange("pow2_scales", 0, 1))
    {
        DSA_TRT_REQUIRE(mExpertOffset < mNumExperts, "field expert_offset=%d must be < num_experts=%d", mExpertOffset,
            mNumExperts);
    }

    void serialize(SerialFields& s) const
    {
        s.addInt("num_experts", &mNumExperts);
        s.addInt("expert_offset", &mExpertOffset);
        s.addInt("weight_format", &mWeightFormat);
        s.addInt("pow2_scales", &mPow2Scales);
    }

    bool supportsType(int32_t pos, nv::DynamicPluginTensorDesc const* io) const
    {
        nv::DataType const t = io[pos].desc.type;
        switch (pos)
        {
        case kX: return t == nv::DataType::kBF16;
        case kTopkIds: return t == nv::DataType::kINT32;
        case kW13:
        case kW2: return t == (mWeightFormat == DSA_MOE_FP8_BLOCK ? nv::DataType::kFP8 : nv::DataType::kBF16);
        default: return t == nv::DataType::kFLOAT; // topk_weights, the scales, out
        }
    }

    void outputTypes(nv::DataType* out, nv::DataType const* /*in*/) const { out[kOut] = nv::DataType::kFLOAT; }

    void outputShapes(nv::DimsExprs const* in, nv::DimsExprs* out, nv::IExprBuilder& /*eb*/) const
    {
        DSA_TRT_REQUIRE(in[kX].nbDims == 2, "x must have rank 2, got %d", in[kX].nbDims);
        out[kOut] = in[kX]; // [T, D]
    }

    void checkShapes(nv::PluginTensorDesc const* in, nv::PluginTensorDesc const* /*out*/) const
    {
        nv::Dims const& x = in[kX].dims;
        nv::Dims const& w13 = in[kW13].dims;
        nv::Dims const& w2 = in[kW2].dims;
        expectRank(x, 2, "x");
        expectRank(in[kTopkIds].dims, 2, "topk_ids");
        expectRank(in[kTopkWeights].dims, 2, "topk_weights");
        expectSameDim(in[kTopkIds].dims, 0, "topk_ids", x, 0, "x");
        expectSameDim(in[kTopkWeights].dims, 0, "topk_weights", x, 0, "x");
        expectSameDim(in[kTopkWeights].dims, 1, "topk_weights", in[kTopkIds].dims, 1, "topk_ids");
        expectRank(w13, 3, "w13");
        expectRank(w2, 3, "w2");
        expectSameDim(w13, 2, "w13", x, 1, "x");
        expectSameDim(w2, 0, "w2", w13, 0, "w13");
        expectSameDim(w2, 1, "w2", x, 1, "x");
        if (w13.d[1] >= 0)
        {
            DSA_TRT_REQUIRE(w13.d[1] % 2 == 0, "w13 dim 1 (2I) must be even (gate rows, then up rows), got %s",
                dimsString(w13).c_str());
            expectDim(w2, 2, w13.d[1] / 2, "w2");
        }
        if (w13.d[0] >= 0)
            DSA_TRT_REQUIRE(mExpertOffset + w13.d[0] <= mNumExperts,
                "expert_offset=%d + %lld local experts (w13 dim 0) exceeds num_experts=%d", mExpertOffset,
                static_cast<long long>(w13.d[0]), mNumExperts);
        for (int32_t i = 1; i < 3; ++i)
        {
            expectInt32(w13.d[i], "w13 extents");
            expectInt32(w2.d[i], "w2 extents");
        }
        if (mWeightFormat == DSA_MOE_BF16)
        {
            for (auto [idx, name] : {std::pair{kW13Scale, "w13_scale"}, std::pair{kW2Scale, "w2_scale"}})
            {
                expectRank(in[idx].dims, 1, name); // placeholder of the bf16 format
                expectDim(in[idx].dims, 0, 1, name);
            }
            return;
        }
        checkScale(in[kW13Scale].dims, w13, "w13_scale");
        checkScale(in[kW2Scale].dims, w2, "w2_scale");
    }

    size_t workspaceBytes(nv::DynamicPluginTensorDesc const* in) const
    {
        nv::Dims const& w2 = in[kW2].max;
        return dsa_moe_experts_workspace_size(in[kX].max.d[0], static_cast<int>(in[kTopkIds].max.d[1]),
            static_cast<int>(w2.d[0]), static_cast<int>(w2.d[1]), static_cast<int>(w2.d[2]), mWeightFormat);
    }

    int launch(nv::PluginTensorDesc const* inDesc, nv::PluginTensorDesc const* /*outDesc*/,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) const
    {
        bool const fp8 = mWeightFormat == DSA_MOE_FP8_BLOCK;
        DsaMoeExpertsParams p{};
        p.x = inputs[kX];
        p.topk_ids = static_cast<int32_t const*>(inputs[kTopkIds]);
        p.topk_weights = static_cast<float const*>(inputs[kTopkWeights]);
        p.w13 = inputs[kW13];
        p.w13_scale = fp8 ? static_cast<float const*>(inputs[kW13Scale]) : nullptr;
        p.w2 = inputs[kW2];
        p.w2_scale = fp8 ? static_cast<float const*>(inputs[kW2Scale]) : nullptr;
        p.out = static_cast<float*>(outputs[kOut]);
        p.num_tokens = inDesc[kX].dims.d[0];
        p.top_k = static_cast<int>(inDesc[kTopkIds].dims.d[1]);
        p.num_experts = mNumExperts;
        p.num_local_experts = static_cast<int>(inDesc[kW2].dims.d[0]);
        p.expert_offset = mExpertOffset;
        p.hidden = static_cast<int>(inDesc[kW2].dims.d[1]);
        p.inter = static_cast<int>(inDesc[kW2].dims.d[2]);
        p.weight_format = mWeightFormat;
        p.pow2_act_scales = mPow2Scales;
        p.workspace = workspace;
        if (p.num_tokens == 0)
            return DSA_OK; // empty output: nothing to write
        return dsa_launch_moe_experts(&p, stream);
    }

private:
    // [E, ceil(rows/128), ceil(cols/128)] for weights [E, rows, cols]; skips unknown extents.
    static void checkScale(nv::Dims const& scale, nv::Dims const& w, char const* name)
    {
        expectRank(scale, 3, name);
        expectSameDim(scale, 0, name, w, 0, name[1] == '1' ? "w13" : "w2");
        for (int32_t i = 1; i < 3; ++i)
            if (w.d[i] >= 0)
                expectDim(scale, i, fp8Blocks(w.d[i]), name);
    }

    int32_t mNumExperts;   // global routed expert count (256 for V3.2)
    int32_t mExpertOffset; // global id of this rank's first expert
    int32_t mWeightFormat; // DsaMoeWeightFormat
    int32_t mPow2Scales;   // as DsaFp8BlockLinear
};

} // namespace

nv::IPluginCreatorV3One& moeExpertsCreator() noexcept
{
    static PluginCreator<MoeExpertsPlugin> creator;
    return creator;
}

} // namespace dsa_trt
