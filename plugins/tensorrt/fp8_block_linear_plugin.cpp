// DsaFp8BlockLinear: out[t, n] = bf16( sum_kb s_x[t, kb] * s_w[n / 128, kb] * sum_{k in kb} q_x[t, k] * w[n, k] ),
// the official W8A8 linear: per-token 1x128 activation quantisation (power-of-two scales when
// pow2_scales), e4m3 products, fp32 accumulation per 128-wide K block. Semantics:
// plugins/fp8_reference.py fp8_block_linear; kernel: dsa_launch_fp8_block_linear (dsa_moe_kernels.h).
#include "plugin_common.h"

namespace dsa_trt
{
namespace
{

class Fp8BlockLinearPlugin : public PluginBase<Fp8BlockLinearPlugin>
{
public:
    enum Input : int32_t
    {
        kX = 0,           // [T, K] bf16
        kWeight = 1,      // [N, K] e4m3 (the checkpoint's weight)
        kWeightScale = 2, // [ceil(N/128), ceil(K/128)] fp32 (its weight_scale_inv)
    };
    enum Output : int32_t
    {
        kOut = 0, // [T, N] bf16
    };

    static constexpr char kName[] = "DsaFp8BlockLinear";
    static constexpr FieldSpec kFields[] = {
        {"pow2_scales", FieldKind::kInt},
    };
    static constexpr int32_t kNbInputs = 3;
    static constexpr int32_t kNbOutputs = 1;

    explicit Fp8BlockLinearPlugin(FieldValues const& f)
        : mPow2Scales(f.intInRange("pow2_scales", 0, 1))
    {
    }

    void serialize(SerialFields& s) const { s.addInt("pow2_scales", &mPow2Scales); }

    bool supportsType(int32_t pos, nv::DynamicPluginTensorDesc const* io) const
    {
        nv::DataType const t = io[pos].desc.type;
        switch (pos)
        {
        case kX: return t == nv::DataType::kBF16;
        case kWeight: return t == nv::DataType::kFP8;
        case kWeightScale: return t == nv::DataType::kFLOAT;
        default: return t == nv::DataType::kBF16; // out
        }
    }

    void outputTypes(nv::DataType* out, nv::DataType const* /*in*/) const { out[kOut] = nv::DataType::kBF16; }

    void outputShapes(nv::DimsExprs const* in, nv::DimsExprs* out, nv::IExprBuilder& /*eb*/) const
    {
        DSA_TRT_REQUIRE(in[kX].nbDims == 2, "x must have rank 2, got %d", in[kX].nbDims);
        DSA_TRT_REQUIRE(in[kWeight].nbDims == 2, "weight must have rank 2, got %d", in[kWeight].nbDims);
        out[kOut].nbDims = 2;
        out[kOut].d[0] = in[kX].d[0];
        out[kOut].d[1] = in[kWeight].d[0];
    }

    void checkShapes(nv::PluginTensorDesc const* in, nv::PluginTensorDesc const* /*out*/) const
    {
        nv::Dims const& x = in[kX].dims;
        nv::Dims const& w = in[kWeight].dims;
        expectRank(x, 2, "x");
        expectRank(w, 2, "weight");
        expectRank(in[kWeightScale].dims, 2, "weight_scale");
        expectSameDim(x, 1, "x", w, 1, "weight");
        if (w.d[0] >= 0)
        {
            expectInt32(w.d[0], "weight rows N");
            expectDim(in[kWeightScale].dims, 0, fp8Blocks(w.d[0]), "weight_scale");
        }
        if (w.d[1] >= 0)
        {
            expectInt32(w.d[1], "weight columns K");
            expectDim(in[kWeightScale].dims, 1, fp8Blocks(w.d[1]), "weight_scale");
        }
    }

    // Split-K partials or quantised activations, whatever the kernel needs: sized for the
    // profile's largest T, which covers every smaller one.
    size_t workspaceBytes(nv::DynamicPluginTensorDesc const* in) const
    {
        return dsa_fp8_block_linear_workspace_size(in[kX].max.d[0], static_cast<int>(in[kWeight].max.d[0]),
            static_cast<int>(in[kWeight].max.d[1]));
    }

    int launch(nv::PluginTensorDesc const* inDesc, nv::PluginTensorDesc const* /*outDesc*/,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) const
    {
        DsaFp8BlockLinearParams p{};
        p.x = inputs[kX];
        p.weight = inputs[kWeight];
        p.weight_scale = static_cast<float const*>(inputs[kWeightScale]);
        p.out = outputs[kOut];
        p.num_tokens = inDesc[kX].dims.d[0];
        p.n = static_cast<int>(inDesc[kWeight].dims.d[0]);
        p.k = static_cast<int>(inDesc[kWeight].dims.d[1]);
        p.x_stride = p.k; // TensorRT linear format: contiguous rows
        p.out_stride = p.n;
        p.pow2_act_scales = mPow2Scales;
        p.workspace = workspace;
        if (p.num_tokens == 0)
            return DSA_OK; // empty output: nothing to write
        return dsa_launch_fp8_block_linear(&p, stream);
    }

private:
    int32_t mPow2Scales; // 1: ue8m0 activation scales (the checkpoint's scale_fmt), 0: fp32 scales
};

} // namespace

nv::IPluginCreatorV3One& fp8BlockLinearCreator() noexcept
{
    static PluginCreator<Fp8BlockLinearPlugin> creator;
    return creator;
}

} // namespace dsa_trt
