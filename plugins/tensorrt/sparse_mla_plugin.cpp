// DsaSparseMla: out[t,h] = sum_j softmax_j(sm_scale * q[t,h] . kv[slot_j]) * kv[slot_j][0:512] over
// the topk slots of token t (-1 skipped; MQA: all heads share the gathered KV), plus the natural-log
// lse. Semantics: plugins/reference.py sparse_mla; kernel: dsa_launch_sparse_mla.
#include "plugin_common.h"

namespace dsa_trt
{
namespace
{

class SparseMlaPlugin : public PluginBase<SparseMlaPlugin>
{
public:
    enum Input : int32_t
    {
        kQ = 0,     // [T, H, 576] bf16, absorbed [q_lat ; q_pe]
        kPool = 1,  // MLA pool [P, 64, 576] bytes (fp8) or bf16
        kSlots = 2, // [T, topk] int32, -1 = skip
    };
    enum Output : int32_t
    {
        kOut = 0, // [T, H, 512] bf16
        kLse = 1, // [T, H] fp32
    };

    static constexpr char kName[] = "DsaSparseMla";
    static constexpr FieldSpec kFields[] = {
        {"num_heads", FieldKind::kInt},
        {"topk", FieldKind::kInt},
        {"kv_scale", FieldKind::kFloat},
        {"sm_scale", FieldKind::kFloat},
        {"cache_format", FieldKind::kInt},
    };
    static constexpr int32_t kNbInputs = 3;
    static constexpr int32_t kNbOutputs = 2;

    explicit SparseMlaPlugin(FieldValues const& f)
        // any count <= 128: dsa_launch_sparse_mla pads those it is not instantiated for (in the workspace)
        : mNumHeads(f.intInRange("num_heads", 1, 128))
        , mTopk(f.intInRange("topk", 1, 1 << 20))
        , mKvScale(f.positiveFloat("kv_scale"))
        , mSmScale(f.positiveFloat("sm_scale"))
        , mCacheFormat(f.cacheFormat())
    {
    }

    void serialize(SerialFields& s) const
    {
        s.addInt("num_heads", &mNumHeads);
        s.addInt("topk", &mTopk);
        s.addFloat("kv_scale", &mKvScale);
        s.addFloat("sm_scale", &mSmScale);
        s.addInt("cache_format", &mCacheFormat);
    }

    bool supportsType(int32_t pos, nv::DynamicPluginTensorDesc const* io) const
    {
        nv::DataType const t = io[pos].desc.type;
        switch (pos)
        {
        case kQ: return t == nv::DataType::kBF16;
        case kPool: return isPoolType(mCacheFormat, t);
        case kSlots: return t == nv::DataType::kINT32;
        case kNbInputs + kOut: return t == nv::DataType::kBF16;
        default: return t == nv::DataType::kFLOAT; // lse
        }
    }

    void outputTypes(nv::DataType* out, nv::DataType const* /*in*/) const
    {
        out[kOut] = nv::DataType::kBF16;
        out[kLse] = nv::DataType::kFLOAT;
    }

    void outputShapes(nv::DimsExprs const* in, nv::DimsExprs* out, nv::IExprBuilder& eb) const
    {
        DSA_TRT_REQUIRE(in[kQ].nbDims == 3, "q must have rank 3, got %d", in[kQ].nbDims);
        out[kOut].nbDims = 3;
        out[kOut].d[0] = in[kQ].d[0];
        out[kOut].d[1] = in[kQ].d[1];
        out[kOut].d[2] = eb.constant(DSA_MLA_V_DIM);
        out[kLse].nbDims = 2;
        out[kLse].d[0] = in[kQ].d[0];
        out[kLse].d[1] = in[kQ].d[1];
    }

    void checkShapes(nv::PluginTensorDesc const* in, nv::PluginTensorDesc const* /*out*/) const
    {
        nv::Dims const& q = in[kQ].dims;
        expectRank(q, 3, "q");
        expectDim(q, 1, mNumHeads, "q");
        expectDim(q, 2, DSA_MLA_DIM, "q");
        int64_t const numPages = checkMlaPool(in[kPool], mCacheFormat, "pool");
        if (numPages >= 0)
            expectInt32(numPages * DSA_PAGE_SIZE, "MLA pool slots (num_pages * 64)"); // slots are int32
        expectRank(in[kSlots].dims, 2, "slots");
        expectSameDim(in[kSlots].dims, 0, "slots", q, 0, "q");
        expectDim(in[kSlots].dims, 1, mTopk, "slots");
    }

    // Split-KV partials of the fp8 kernel at small T; sized for the profile's largest T, which
    // covers every smaller one (dsa_kernels.h). 0 in bf16 mode.
    size_t workspaceBytes(nv::DynamicPluginTensorDesc const* in) const
    {
        return dsa_sparse_mla_workspace_size(in[kQ].max.d[0], mNumHeads, mTopk, mCacheFormat);
    }

    int launch(nv::PluginTensorDesc const* inDesc, nv::PluginTensorDesc const* /*outDesc*/,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) const
    {
        DsaSparseMlaParams p{};
        p.q = inputs[kQ];
        p.pool = inputs[kPool];
        p.slots = static_cast<int32_t const*>(inputs[kSlots]);
        p.out = outputs[kOut];
        p.lse = static_cast<float*>(outputs[kLse]);
        p.num_tokens = inDesc[kQ].dims.d[0];
        p.num_heads = mNumHeads;
        p.topk = mTopk;
        p.q_stride_head = DSA_MLA_DIM; // TensorRT linear format: contiguous [T, H, 576]
        p.q_stride_token = static_cast<int64_t>(mNumHeads) * DSA_MLA_DIM;
        p.num_slots = inDesc[kPool].dims.d[0] * DSA_PAGE_SIZE;
        p.kv_scale = mKvScale;
        p.sm_scale = mSmScale;
        p.format = mCacheFormat;
        p.num_splits = 0; // auto: split the top-k list across CTAs when T is small
        p.workspace = workspace;
        if (p.num_tokens == 0)
            return DSA_OK; // empty output: nothing to write
        return dsa_launch_sparse_mla(&p, stream);
    }

private:
    int32_t mNumHeads;    // heads of this rank: 128 / tp for V3.2
    int32_t mTopk;        // slots per token (index_topk)
    float mKvScale;       // fp8 dequant: kv = e4m3 * kv_scale; unused (but kept) in bf16 mode
    float mSmScale;       // softmax scale of the absorbed 576-d dot product
    int32_t mCacheFormat; // DsaCacheFormat
};

} // namespace

nv::IPluginCreatorV3One& sparseMlaCreator() noexcept
{
    static PluginCreator<SparseMlaPlugin> creator;
    return creator;
}

} // namespace dsa_trt
